"""K runs in one MultiRunTrainer beside the same K runs in K separate trainer processes at once.

    python -m benchmarks.multirun_throughput [--quick] [--runs 4] [--steps 6] [--threads T] [--warmup-steps 0]

Both sides are the real trainer process (`python -m rlplex.multirun.trainer`), fed by
synthetic rollouts that this benchmark writes beforehand (the same rows for both sides), so
the figures are trainer-only. Timing starts when every run's `broadcast/step_<warmup-steps>`
exists (start-up and model building excluded; on a GPU leave a step or two out as well, for
the kernels' first-call costs: `--steps 30 --warmup-steps 2`) and ends when every run's
`broadcast/step_<steps>` exists. Aggregate tokens/s counts real (attention) tokens of the rows
trained in that window. Peak memory is the VmHWM (peak RSS) of each command's trainer rank.
Threads are split evenly: one trainer gets `--threads`, each of the K separate trainers
`--threads / K` (at least 1).

Goals (issue 5): at least 2.5x the aggregate throughput of the separate processes, and peak
memory at most 1.5x that of a single-run trainer.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from benchmarks.common import report, tiny_checkpoint
from rlplex.models.hf import load_causal_lm, load_tokenizer
from rlplex.models.lm import token_logprobs
from rlplex.models.spec import ModelSpec
from rlplex.multirun import OrchestratorConfig, create_run
from rlplex.multirun.rundir import RunDir
from rlplex.multirun.rundir.peft_export import is_stable_adapter
from rlplex.multirun.rundir.rollouts import RolloutBatch, write_rollouts

NAME = "multirun_throughput"
TRAINER_LOG = "trainer_command.log"
SRC = Path(__file__).resolve().parents[1] / "src"


def untrained_model() -> ModelSpec:
    """The tiny checkpoint without warm-up: the trainer's speed does not depend on the weights."""
    return ModelSpec(name=str(tiny_checkpoint(warmup_steps=0)))


def make_batches(runs: int, steps: int, n: int, width: int) -> list[list[RolloutBatch]]:
    spec = untrained_model()
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


def prepare(output_dir: Path, run_ids: list[int], batches: list[list[RolloutBatch]], steps: int) -> list[RunDir]:
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
                "model": {"name": untrained_model().name},  # the untrained tiny LM, as make_batches scores with
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


def wait_all(paths: list[Path], procs: list[subprocess.Popen[bytes]], logs: list[Path], timeout_s: float) -> None:
    """Until every adapter in `paths` is written; a trainer that exits first fails with its log's tail."""
    deadline = time.monotonic() + timeout_s
    while not all(is_stable_adapter(p) for p in paths):
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
    """`python -m rlplex.multirun.trainer` for `output_dir` (world size 1), `extra` appended."""
    command = [sys.executable, "-m", "rlplex.multirun.trainer", "--output-dir", str(output_dir)]
    return [*command, "--max-runs", str(max_runs), "--threads", str(threads), *extra]


def measure(
    groups: list[tuple[Path, list[RunDir]]], threads: int, steps: int, micro_tokens: int, warmup: int = 0
) -> dict[str, float]:
    """Start one trainer per group at once; seconds from all step_<warmup> to all step_<steps>, and peak RSS."""
    env = process_env(threads)
    procs, logs = [], [output_dir / TRAINER_LOG for output_dir, _ in groups]
    for (output_dir, runs), log_path in zip(groups, logs, strict=True):
        command = trainer_command(output_dir, len(runs), threads, "--micro-tokens", str(micro_tokens))
        command += ["--checkpoint-every", str(10 * steps), "--model", untrained_model().name]
        with log_path.open("wb") as log:
            procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    all_runs = [run for _, runs in groups for run in runs]
    try:
        wait_all([run.broadcast_step(0) for run in all_runs], procs, logs, 300)
        t0 = time.perf_counter()
        release(all_runs)
        if warmup:  # first steps pay one-time costs (a GPU's kernels and handles): not in the window
            wait_all([run.broadcast_step(warmup) for run in all_runs], procs, logs, 600)
            t0 = time.perf_counter()
        wait_all([run.broadcast_step(steps) for run in all_runs], procs, logs, 600)
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
    return {"seconds": seconds, "peak_rss_mb_total": sum(rss), "peak_rss_mb_max": max(rss)}


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
    args = parser.parse_args()
    if args.quick:
        args.steps, args.samples = 3, 32
    k, steps = args.runs, args.steps
    step_tokens = args.samples * args.width
    batches = make_batches(k, steps, args.samples, args.width)
    if not 0 <= args.warmup_steps < steps:
        parser.error(f"--warmup-steps {args.warmup_steps} must be below --steps {steps}")
    tokens = k * (steps - args.warmup_steps) * args.samples * args.width  # trained inside the timed window
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shared_dir = root / "shared"
        shared = measure(
            [(shared_dir, prepare(shared_dir, list(range(k)), batches, steps))],
            args.threads,
            steps,
            k * step_tokens,
            args.warmup_steps,
        )  # one micro-batch holds one step of every run: one forward pass for all K
        separate_groups = []
        for i in range(k):
            directory = root / f"separate_{i}"
            separate_groups.append((directory, prepare(directory, [i], batches, steps)))
        separate = measure(separate_groups, max(1, args.threads // k), steps, step_tokens, args.warmup_steps)
    rows = []
    for name, result, procs in (("one trainer, K runs", shared, 1), ("K trainers, 1 run each", separate, k)):
        rows.append([name, procs, result["seconds"], tokens / result["seconds"], result["peak_rss_mb_total"]])
    speedup = separate["seconds"] / shared["seconds"]
    memory_ratio = shared["peak_rss_mb_max"] / separate["peak_rss_mb_max"]
    figures = {
        "runs": k,
        "steps": steps,
        "warmup_steps": args.warmup_steps,
        "samples": args.samples,
        "width": args.width,
        "threads": args.threads,
        "tokens": tokens,
        "shared": shared,
        "separate": separate,
        "throughput_ratio": speedup,
        "memory_vs_single_run_trainer": memory_ratio,
        "goals": {"throughput_ratio_at_least": 2.5, "memory_ratio_at_most": 1.5},
    }
    report(
        NAME,
        f"K={k} runs, {steps} steps x {args.samples} rows x {args.width} tokens; throughput ratio {speedup:.2f}x, "
        f"peak memory vs one single-run trainer {memory_ratio:.2f}x",
        ["setup", "processes", "seconds", "tokens/s", "peak RSS MB (sum)"],
        rows,
        figures,
    )


if __name__ == "__main__":
    main()
