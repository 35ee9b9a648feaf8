"""GRPO on a toy task with the tiny language model, through the one LM-RL path: a main job with
one run, synchronous (`max_async_level` 0) and asynchronous (1 and 4), the asynchronous ones with
plain PPO and with AReaL's decoupled PPO (`loss.decoupled`, behaviour importance weights capped
at `--cap`), one job after the other on the same machine.

    python -m benchmarks.grpo_learning [--quick] [--task reverse] [--engine vllm] [--steps N]

Each job is `rlplex run`'s own driver (`run_main_job`) on a job of one run: one trainer rank and
one orchestrator generating with `--engine` (hf: transformers in the orchestrator; vllm: one
vLLM(-CPU) server of the job, the run's LoRA adapter hot-loaded after every step). The run's
held-out evaluation (`evaluation`: `--eval-examples` problems sampled at temperature 1, every 10
steps) is the curve; the seconds to the target are the job's wall time at the first evaluation
whose reward reaches it (read as the rows appear). The policy is the run's LoRA adapter
(`--lora-rank`, lr `--lr`) on the frozen tiny checkpoint, warmed up for `--warmup-steps`.

Goal (issue 33): the best setting's final reward at least as high as the single-run runner's
(`benchmarks.grpo_runner_learning`: 0.81 at eta 0, all weights trained), the largest policy lag
within each setting's bound, and the decoupled settings at least as good as plain at the same
lag. Curves to PNG.
"""

from __future__ import annotations

import argparse
import csv
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.common import RESULTS, report, tiny_checkpoint
from rlplex.config import validate_config
from rlplex.diagnostics import plot_learning_curves
from rlplex.mainjob.config import MainJobConfig
from rlplex.mainjob.driver import run_main_job

NAME = "grpo_learning"
ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ((0, False), (1, False), (1, True), (4, False), (4, True))
EVAL_REWARD = "eval/reward_t1"
RUN_ID = "run_grpo"
# The attention and MLP projections, and the output head: without an adapter on `lm_head` the
# final norm bounds how sharp the policy can get, and the tiny model's reward stalls at about 0.63.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def job_name(eta: int, decoupled: bool) -> str:
    return f"grpo-eta{eta}{'-decoupled' if decoupled else ''}"


def job_config(args: argparse.Namespace, eta: int, decoupled: bool, output_dir: Path, model: Path) -> MainJobConfig:
    run = {
        "env": {"name": args.task},
        "seed": args.seed,
        "max_steps": args.steps,
        "batch_size": args.batch_size,
        "group_size": args.group_size,
        "max_async_level": eta,
        "model": {"lora": {"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank}},
        "optim": {"lr": args.lr},
        "loss": {"decoupled": decoupled, "behav_imp_weight_cap": args.cap},
        "evaluation": {"every": 10, "examples": args.eval_examples, "temperatures": [1.0]},
    }
    data: dict[str, Any] = {
        "name": job_name(eta, decoupled),
        "output_dir": str(output_dir),
        "model": {"name": str(model)},
        "inference": {"engine": args.engine, "max_model_len": 128, "max_lora_rank": args.lora_rank},
        "trainer": {
            "world_size": 1,
            "max_runs": 1,
            "max_lora_rank": args.lora_rank,
            "checkpoint_every": 50,
            "target_modules": args.target_modules.split(",") if args.target_modules else None,
        },
        "logging": {"tensorboard": False},
        "runs": [{"id": RUN_ID, "config": run}],
    }
    return validate_config(MainJobConfig, data, source=f"benchmarks.grpo_learning eta={eta}")


class EvalWatch(threading.Thread):
    """Records when each evaluation row first appears in the run's `eval/progress.csv` (seconds
    since the job started): the file is only appended to, so a row's time is when it was seen."""

    def __init__(self, path: Path, started: float) -> None:
        super().__init__(daemon=True)
        self.path, self.started = path, started
        self.seen: dict[int, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):  # a measurement at 1 s resolution, not a synchronisation
            for step, _ in read_curve(self.path):
                self.seen.setdefault(step, time.monotonic() - self.started)


def read_curve(path: Path) -> list[tuple[int, float]]:
    try:
        with open(path, newline="") as handle:
            rows = list(csv.DictReader(handle))
    except OSError:
        return []
    return [(int(float(r["step"])), float(r[EVAL_REWARD])) for r in rows if r.get(EVAL_REWARD)]


def max_policy_lag(run_dir: Path) -> int:
    with open(run_dir / "progress.csv", newline="") as handle:
        return max(int(float(r["charts/policy_lag"])) for r in csv.DictReader(handle))


def run_setting(args: argparse.Namespace, eta: int, decoupled: bool, model: Path) -> dict[str, Any]:
    label = f"eta={eta}" + (" decoupled" if decoupled else "")
    out = ROOT / "outputs" / f"bench-{job_name(eta, decoupled)}"
    shutil.rmtree(out, ignore_errors=True)
    config = job_config(args, eta, decoupled, out, model)
    started = time.monotonic()
    watch = EvalWatch(out / "runs" / RUN_ID / "eval" / "progress.csv", started)
    watch.start()
    try:
        with open(out.parent / f"{out.name}.log", "w") as log:
            state = run_main_job(config, Console(file=log), live=False, source=label)
    finally:
        watch.stop.set()
        watch.join()
    wall = time.monotonic() - started
    curve = read_curve(out / "runs" / RUN_ID / "eval" / "progress.csv")
    if state.value == "FAILED" or not curve:
        raise RuntimeError(f"{label}: the job ended {state.value} with {len(curve)} evaluations (log: {out}.log)")
    reached = next((watch.seen.get(step, wall) for step, reward in curve if reward >= args.target), None)
    return {
        "setting": label,
        "eta": eta,
        "decoupled": decoupled,
        "state": state.value,
        "wall_time_s": wall,
        "curve": curve,
        "initial_reward": curve[0][1],
        "final_reward": curve[-1][1],
        "best_reward": max(r for _, r in curve),
        "target_reached_at_s": reached,
        "max_policy_lag": max_policy_lag(out / "runs" / RUN_ID),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="20 steps per setting")
    parser.add_argument("--task", default="reverse")
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--warmup-steps", type=int, default=75, help="supervised warm-up of the tiny checkpoint")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="where rollouts are generated")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument(
        "--target-modules",
        default=",".join(TARGETS),
        help="the adapter's layers ('': the model family's default, without the output head)",
    )
    parser.add_argument("--steps", type=int, default=200, help="steps per setting")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--eval-examples", type=int, default=256)
    parser.add_argument("--cap", type=float, default=5.0, help="decoupled PPO's behaviour importance weight cap")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--settings", default=",".join(f"{e}{'d' if d else ''}" for e, d in SETTINGS), help="e.g. 0,1,1d,4,4d"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 20
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = [(int(s.rstrip("d")), s.endswith("d")) for s in args.settings.split(",")]
    model = tiny_checkpoint(tasks=(args.task,), warmup_steps=args.warmup_steps)
    runs = [run_setting(args, eta, decoupled, model) for eta, decoupled in settings]
    sync = next((r["target_reached_at_s"] for r in runs if r["eta"] == 0), None)
    for run in runs:
        reached = run["target_reached_at_s"]
        run["speedup_over_sync"] = (sync / reached) if (sync and reached and run["eta"]) else None
    png = plot_learning_curves(
        {r["setting"]: ([s for s, _ in r["curve"]], [v for _, v in r["curve"]]) for r in runs},
        RESULTS / f"{NAME}{'' if args.engine == 'hf' else '_vllm'}.png",
        title=f"GRPO on '{args.task}' in a main job of one run: plain vs decoupled PPO",
        xlabel="policy step",
        ylabel="held-out reward (T = 1)",
        hline=args.target,
    )
    rows = [
        (
            r["setting"],
            r["initial_reward"],
            r["final_reward"],
            r["best_reward"],
            r["wall_time_s"],
            r["target_reached_at_s"] if r["target_reached_at_s"] is not None else "not reached",
            r["max_policy_lag"],
        )
        for r in runs
    ]
    columns = ("setting", "reward at step 0", "final reward", "best", "wall s", "s to target", "max lag")
    report(
        NAME if args.engine == "hf" else f"{NAME}_vllm",
        f"GRPO {args.task} ({args.engine}), {args.steps} steps x {args.batch_size}: sync vs async, plain vs decoupled",
        columns,
        rows,
        {"runs": runs, "target": args.target, "args": vars(args), "curves_png": str(png)},
    )


if __name__ == "__main__":
    main()
