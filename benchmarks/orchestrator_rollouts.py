"""Rollout throughput of one run's orchestrator, with the trainer taken out of the loop.

    python -m benchmarks.orchestrator_rollouts [--quick] [--steps 8] [--batch 64] [--group 8] [--threads 1]
        [--rollout-workers 1]

The run's `broadcast/step_0` and `broadcast/step_<steps>` are written beforehand (one random
adapter) and `max_async_level = steps`, so the orchestrator never waits for a trainer: it
generates, scores and writes every step back to back and exits. The base model is the tiny
checkpoint, built (and cached) before timing starts. Figures: the orchestrator's own `charts/tokens_per_s`
(generated tokens over the generation MFC's time, mean over steps), end-to-end generated tokens per
wall second, and wall seconds per step (everything: eviction check, adapter load, generation,
reward, advantages, writing `rollouts/step_N`, progress.csv), and CPU seconds per step (this
process's threads only, so other load on the machine does not inflate it).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.common import report, tiny_checkpoint
from rlplex.diagnostics.metrics import read_metrics_csv
from rlplex.models.hf import load_causal_lm
from rlplex.multirun import OrchestratorConfig, apply_multi_lora, create_run, write_peft_adapter
from rlplex.multirun.orchestrator.loop import WaitOptions, run_orchestrator
from rlplex.multirun.rundir.rollouts import rollouts_ready
from rlplex.multirun.trainer.log import ProgressLog

NAME = "orchestrator_rollouts"
TARGETS = ("q_proj", "v_proj")
RUN_ID = "run_bench"


def make_config(steps: int, batch: int, group: int, warmup: int, rollout_workers: int = 1) -> OrchestratorConfig:
    extra = {"rollout_workers": rollout_workers} if rollout_workers != 1 else {}  # older configs lack the key
    return OrchestratorConfig.model_validate(
        {
            **extra,
            "env": {"name": "reverse"},
            "max_steps": steps,
            "batch_size": batch,
            "group_size": group,
            "max_async_level": steps,
            "model": {"name": str(tiny_checkpoint(warmup_steps=warmup)), "lora": {"rank": 8, "alpha": 16.0}},
        }
    )


def write_broadcasts(out: Path, config: OrchestratorConfig) -> threading.Thread:
    """`broadcast/step_0` now, and `broadcast/step_<max_steps>` (which ends the orchestrator's
    last wait) once the last step's rollouts are written: written before, it would tell a
    starting orchestrator that every step is trained already. Returns the thread that waits."""
    import copy

    model = copy.deepcopy(load_causal_lm(config.model))
    lora = apply_multi_lora(model, target_modules=TARGETS, rank=config.model.lora.rank, n_adapters=1)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, param in lora.named_parameters_for_adapter(0):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    run = create_run(out, RUN_ID, config)  # what the orchestrator does first; it reuses the run
    state = lora.adapter_state_dict(0)

    def write(step: int) -> None:
        write_peft_adapter(
            run.broadcast_step(step),
            state,
            config.model.name,
            rank=config.model.lora.rank,
            alpha=config.model.lora.alpha,
            target_modules=TARGETS,
        )

    def last() -> None:
        deadline = time.monotonic() + 600
        while not rollouts_ready(run, config.max_steps - 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        write(config.max_steps)
        # The trainer's row of the step, just after its broadcast as the trainer writes it: without
        # it the finished orchestrator waits FINAL_ROW_WAIT_S for the row, inside the measured time.
        ProgressLog().append(run, {"step": config.max_steps, "time": time.time(), "loss": 0.0})

    write(0)
    thread = threading.Thread(target=last, daemon=True)
    thread.start()
    return thread


def measure(config: OrchestratorConfig) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="rlplex-orch-bench-") as tmp:
        out = Path(tmp)
        trainer = write_broadcasts(out, config)
        t0, cpu0 = time.perf_counter(), time.process_time()
        run_orchestrator(out, RUN_ID, config, WaitOptions(timeout_s=60), tensorboard=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        trainer.join()
        rows = read_metrics_csv(out / RUN_ID / "progress.csv")
    generated = sum(row["charts/generated_tokens"] for row in rows)
    return {
        "steps": float(len(rows)),
        "charts_tokens_per_s": statistics.mean(row["charts/tokens_per_s"] for row in rows),
        "wall_tokens_per_s": generated / wall,
        "wall_s_per_step": wall / len(rows),
        "cpu_s_per_step": cpu / len(rows),  # all of the process's threads: load from others does not count
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="4 steps of 32 samples, a short warm-up")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="runs measured; the median is reported")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rollout-workers", type=int, default=1, help="generation processes (1: in process)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    steps, batch, warmup = (4, 32, 20) if args.quick else (args.steps, args.batch, 120)
    config = make_config(steps, batch, args.group, warmup, args.rollout_workers)
    results = [measure(config) for _ in range(args.repeats)]  # the checkpoint was built above: not timed
    figures = {key: statistics.median(r[key] for r in results) for key in results[0]}
    rows = [(key, value) for key, value in figures.items()]
    report(
        NAME,
        f"orchestrator rollouts: {steps} steps x {batch} samples, median of {args.repeats}",
        ["figure", "value"],
        rows,
        {
            "config": {"steps": steps, "batch": batch, "group": args.group, "rollout_workers": args.rollout_workers},
            "runs": results,
            "median": figures,
        },
    )


if __name__ == "__main__":
    main()
