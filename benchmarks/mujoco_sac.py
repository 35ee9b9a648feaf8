"""SAC on a MuJoCo task: rlplex beside Stable-Baselines3, same budget, same settings.

    python -m benchmarks.mujoco_sac --env HalfCheetah-v5 --steps 20000 --seeds 3
    python -m benchmarks.mujoco_sac --quick        # 1 seed, 2,000 steps

Both run rl-zoo's SAC settings for MuJoCo (examples/halfcheetah_sac.toml: SB3's defaults, lr
3e-4, batch 256, 256x256 actor and twin critics, tau 0.005, gamma 0.99, automatic entropy,
one gradient step per env step, one env) with `learning_starts` steps of uniform random
actions first (rl-zoo: 10,000; here `--learning-starts`, default a fifth of the budget up to
10,000, so that a short run still learns). Both use one torch thread and rlplex's
`Evaluator` (`--eval-episodes` deterministic episodes on the same evaluation seeds) every
`--eval-every` env steps; evaluation time is excluded from the wall times. Runs alternate
rlplex / SB3 per seed so that machine noise hits both.

Goals (issue 15): rlplex's final evaluation return at least SB3's (median over seeds) and
its wall time at most 0.7x SB3's. A comparison of final returns that means something needs
the rl-zoo budget (1M steps; SAC's HalfCheetah curves separate after ~100k); short budgets
measure speed and check that both learn. Writes bench_results/mujoco_sac.json and .png.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import RESULTS, TimedEvaluator, override, report
from rlplex.runners.config import SACSection, TrainConfig, build_runner, load_train_config

CONFIG = Path(__file__).resolve().parent.parent / "examples" / "halfcheetah_sac.toml"
TIME_GOAL = 0.7


@dataclass
class Run:
    library: str
    seed: int
    train_s: float  # wall time, evaluation excluded
    eval_s: float
    train_cpu_s: float  # this process's CPU time, evaluation excluded (steadier on a shared machine)
    curve: list[tuple[int, float]] = field(default_factory=list)  # (env steps, mean eval return)

    @property
    def final(self) -> float:
        return self.curve[-1][1] if self.curve else float("nan")


def rlplex_config(env_id: str, steps: int, learning_starts: int, eval_every: int, seed: int) -> TrainConfig:
    config = load_train_config(CONFIG)
    config = override(config, "env", id=env_id)
    config = override(config, "algo", learning_starts=learning_starts)
    return override(config, "runner", n_steps=steps, seed=seed, log_interval_steps=eval_every, snapshot_mode="none")


def run_rlplex(config: TrainConfig, eval_episodes: int) -> Run:
    seed = config.runner.seed
    t0, c0 = time.perf_counter(), time.process_time()
    runner = build_runner(config, output_dir=None, show_progress=False)
    runner.evaluator = TimedEvaluator(config.env, eval_episodes, seed=seed)
    result = runner.train()
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    curve = [
        (int(row["charts/env_steps"]), float(row["charts/eval_return_mean"]))
        for row in result.history
        if "charts/eval_return_mean" in row
    ]
    evaluator = runner.evaluator
    return Run("rlplex", seed, total - evaluator.seconds, evaluator.seconds, cpu - evaluator.cpu_seconds, curve)


class _Sb3EvalAgent:
    """Lets rlplex's `Evaluator` drive an SB3 policy, so both libraries share one evaluation."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def eval_step(self, observation: np.ndarray) -> np.ndarray:
        action, _ = self.model.predict(observation, deterministic=True)
        return np.asarray(action)


def run_sb3(config: TrainConfig, eval_episodes: int) -> Run:
    from stable_baselines3 import SAC
    from stable_baselines3.common.callbacks import BaseCallback

    algo, seed, every = config.algo, config.runner.seed, config.runner.log_interval_steps
    assert isinstance(algo, SACSection)
    evaluator = TimedEvaluator(config.env, eval_episodes, seed=seed)
    curve: list[tuple[int, float]] = []

    class Evaluate(BaseCallback):
        def _on_step(self) -> bool:
            if self.num_timesteps % every == 0 or self.num_timesteps == config.runner.n_steps:
                returns, _ = evaluator.evaluate(_Sb3EvalAgent(self.model))  # type: ignore[arg-type]
                curve.append((self.num_timesteps, float(np.mean(returns))))
            return True

    t0, c0 = time.perf_counter(), time.process_time()
    model = SAC(
        "MlpPolicy",
        config.env.id,
        learning_rate=algo.learning_rate,
        buffer_size=algo.buffer_size,
        learning_starts=algo.learning_starts,
        batch_size=algo.batch_size,
        tau=algo.tau,
        gamma=algo.gamma,
        policy_kwargs={"net_arch": list(config.agent.hidden)},
        device="cpu",
        seed=seed,
        verbose=0,
    )
    model.learn(total_timesteps=config.runner.n_steps, callback=Evaluate())
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    evaluator.close()
    return Run("sb3", seed, total - evaluator.seconds, evaluator.seconds, cpu - evaluator.cpu_seconds, curve)


def plot(runs: list[tuple[Run, Run]], env_id: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for ours, theirs in runs:
        for run, color in ((ours, "tab:blue"), (theirs, "tab:orange")):
            if run.curve:
                steps, returns = zip(*run.curve, strict=True)
                ax.plot(steps, returns, color=color, alpha=0.8, label=f"{run.library} seed {run.seed}")
    ax.set_xlabel("env steps")
    ax.set_ylabel("mean evaluation return")
    ax.set_title(f"SAC on {env_id}: rlplex (blue) vs Stable-Baselines3 (orange)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="HalfCheetah-v5")
    parser.add_argument("--steps", type=int, default=None, help="env steps per run (default 20,000; --quick 2,000)")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds, 0..N-1 (default 3; --quick 1)")
    parser.add_argument("--learning-starts", type=int, default=None, help="default min(10,000, steps / 5)")
    parser.add_argument("--eval-every", type=int, default=None, help="env steps between evaluations (steps / 4)")
    parser.add_argument("--eval-episodes", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    # The first Adam of a process imports torch._dynamo (about a second): keep it out of both.
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])
    steps = args.steps or (2_000 if args.quick else 20_000)
    n_seeds = args.seeds or (1 if args.quick else 3)
    learning_starts = args.learning_starts if args.learning_starts is not None else min(10_000, steps // 5)
    eval_every = args.eval_every or max(1, steps // 4)
    runs: list[tuple[Run, Run]] = []
    for seed in range(n_seeds):
        config = rlplex_config(args.env, steps, learning_starts, eval_every, seed)
        pair = (run_rlplex(config, args.eval_episodes), run_sb3(config, args.eval_episodes))
        for run in pair:
            print(
                f"  seed {seed} {run.library:6s}: {run.train_s:7.1f} s wall, {run.train_cpu_s:7.1f} s CPU, "
                f"final return {run.final:9.1f}",
                flush=True,
            )
        runs.append(pair)
    sides = {"rlplex": [o for o, _ in runs], "sb3": [t for _, t in runs]}
    median = {
        name: {
            "final_return": statistics.median(r.final for r in side),
            "train_s": statistics.median(r.train_s for r in side),
            "train_cpu_s": statistics.median(r.train_cpu_s for r in side),
        }
        for name, side in sides.items()
    }
    time_ratio = statistics.median(o.train_s / t.train_s for o, t in runs)
    cpu_ratio = statistics.median(o.train_cpu_s / t.train_cpu_s for o, t in runs)
    rows: list[tuple[Any, ...]] = [
        (o.seed, o.final, t.final, o.train_s, t.train_s, o.train_s / t.train_s, o.train_cpu_s / t.train_cpu_s)
        for o, t in runs
    ]
    m = median
    rows.append(
        (
            "median",
            m["rlplex"]["final_return"],
            m["sb3"]["final_return"],
            m["rlplex"]["train_s"],
            m["sb3"]["train_s"],
            time_ratio,
            cpu_ratio,
        )
    )
    RESULTS.mkdir(exist_ok=True)
    png = RESULTS / "mujoco_sac.png"
    plot(runs, args.env, png)
    report(
        "mujoco_sac",
        f"SAC on {args.env}, {steps:,} steps ({learning_starts:,} random), {n_seeds} seed(s); wall s exclude "
        f"evaluation (goals: rlplex return >= sb3's, time ratio <= {TIME_GOAL})",
        ["seed", "rlplex return", "sb3 return", "rlplex s", "sb3 s", "rlplex / sb3 wall", "rlplex / sb3 CPU"],
        rows,
        {
            "env": args.env,
            "steps": steps,
            "learning_starts": learning_starts,
            "eval_every": eval_every,
            "eval_episodes": args.eval_episodes,
            "seeds": n_seeds,
            "config": str(CONFIG),
            "runs": [{"rlplex": asdict(o), "sb3": asdict(t)} for o, t in runs],
            "median": median,
            "median_time_ratio": time_ratio,
            "median_cpu_time_ratio": cpu_ratio,
            "return_goal_met": median["rlplex"]["final_return"] >= median["sb3"]["final_return"],
            "time_goal_met": time_ratio <= TIME_GOAL,
            "figure": str(png),
        },
    )
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
