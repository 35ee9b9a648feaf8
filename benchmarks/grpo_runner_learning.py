"""The single-run dataflow GRPO runner (`rlplex.runners.grpo_lm`, all weights trained) on the toy
task: synchronous (eta = 0) and asynchronous (eta = 1, 4), the asynchronous ones with plain PPO and
with AReaL's decoupled PPO (proximal log-probs recomputed by the `actor_prox` MFC, behaviour
importance weights capped at `--cap`), side by side in one run.

    python -m benchmarks.grpo_runner_learning [--quick] [--task reverse] [--engine vllm] [--max-steps N]

The reference `benchmarks.grpo_learning` (the same settings on the main job, LoRA on the shared
trainer) is compared against until the runner goes (issue 33). `--engine vllm`: the rollouts run
on a vLLM(-CPU) server the runner starts, and the policy is a LoRA adapter (rank `--lora-rank`)
hot-loaded into it after every step (lr `--lr`).

Reports wall time to the target (0.8), async speed-up over sync, the largest staleness seen
(<= eta), and why each side waited. Curves to PNG.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import RESULTS, report, tiny_checkpoint
from rlplex.diagnostics import plot_learning_curves
from rlplex.runners.grpo_lm import GRPOLMConfig, train_grpo_lm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--task", default="reverse")
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--warmup-steps", type=int, default=75, help="supervised warm-up of the tiny checkpoint")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="where rollouts are generated")
    parser.add_argument("--lora-rank", type=int, default=8, help="with --engine vllm: the trained adapter's rank")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-3; 5e-3 with vllm)")
    parser.add_argument("--max-steps", type=int, default=None, help="steps per setting at most (default 400)")
    parser.add_argument("--rollout-workers", type=int, default=1, help="rollout worker threads per setting")
    parser.add_argument("--cap", type=float, default=5.0, help="decoupled PPO's behaviour importance weight cap")
    args = parser.parse_args()
    torch.set_num_threads(1)
    name = "grpo_learning_runner"
    steps = args.max_steps or (30 if args.quick else 400)
    runs, rows, curves = [], [], {}
    settings = [(0, False), (1, False), (1, True), (4, False), (4, True)]
    for eta, decoupled in settings:
        label = f"eta={eta}" + (" decoupled" if decoupled else "")
        config = GRPOLMConfig(
            model={"name": str(tiny_checkpoint(tasks=(args.task,), warmup_steps=args.warmup_steps))},
            env={"name": args.task},
            eta=eta,
            steps=steps,
            eval_every=10,
            target_reward=args.target,
            inference={"engine": args.engine, "max_model_len": 128},
            lora_rank=args.lora_rank,
            lr=args.lr or (5e-3 if args.engine == "vllm" else 1e-3),
            decoupled=decoupled,
            behav_imp_weight_cap=args.cap,
            rollout_workers=args.rollout_workers,
        )
        result = train_grpo_lm(config)
        curves[label] = ([s for s, _, _ in result.curve], [r for _, r, _ in result.curve])
        runs.append({"eta": eta, "decoupled": decoupled, "config": config.model_dump(), **result.__dict__})
        rows.append(
            (
                label,
                result.initial_reward,
                result.final_reward,
                result.steps,
                result.wall_time_s,
                result.target_reached_at_s if result.target_reached_at_s is not None else "not reached",
                result.max_staleness,
                result.dropped_stale,
            )
        )
    sync_time = runs[0]["target_reached_at_s"]
    for run in runs[1:]:
        reached = run["target_reached_at_s"]
        run["speedup_over_sync"] = (sync_time / reached) if (sync_time and reached) else None
    png = plot_learning_curves(
        curves,
        RESULTS / f"{name}.png",
        title=f"GRPO on '{args.task}': plain vs decoupled PPO",
        xlabel="train steps",
        ylabel="eval reward",
        hline=args.target,
    )
    columns = ("setting", "warm-up reward", "final reward", "steps", "wall s", "s to target", "max staleness")
    columns = (*columns, "dropped stale")
    report(
        name,
        f"GRPO {args.task} ({args.engine}): sync vs async, plain vs decoupled PPO",
        columns,
        rows,
        {"runs": runs, "target": args.target, "curves_png": str(png)},
    )


if __name__ == "__main__":
    main()
