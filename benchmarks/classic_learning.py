"""SAC, TD3, DDPG (Pendulum-v1), A2C, the full DQN and C51 (CartPole-v1) learn, with the
settings of their example files (rl-zoo's where rl-zoo has them), one seed after another.

Goals (issue 15): SAC and TD3 reach a deterministic evaluation return >= -200 on Pendulum-v1
within 20k environment steps, and A2C and the full DQN (double + dueling + prioritized +
3-step) >= 475 on CartPole-v1, each in at least 4 of 5 seeds (the DQN within 20 minutes a
seed). DDPG and C51 have no goal; they are run for comparison. A seed stops at its target unless --no-stop
(then it runs its whole budget and the final evaluation is at the budget's end).

On the partially observed rlplex/CartPoleNoVel-v1 (no velocities), R2D1 and recurrent PPO
(`ppo_lstm`) should reach >= 400 in at least 3 of 5 seeds; the feed-forward PPO of
cartpole_ppo.toml on the same task (`ppo_ff_novel`, 100k steps, no goal) is run with the same
seeds beside each of them, for comparison. `a2c_lstm` (no goal) is A2C's settings with an LSTM
agent (64 units) on the same task, 500k steps. `r2d1_async` (no goal) is R2D1's settings under
AsyncRl, in 20-step batches (its sequences span batches there through the copiers' shared carry).

    python -m benchmarks.classic_learning --algo sac --seeds 5
    python -m benchmarks.classic_learning --algo r2d1 --seeds 3   # + the feed-forward baseline
    python -m benchmarks.classic_learning [--quick]      # every algorithm, 5 seeds (2 with --quick)

Prints a table, writes bench_results/classic_<algo>.json and a PNG of the learning curves.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, override, report
from rlplex.diagnostics import plot_learning_curves
from rlplex.runners.config import build_runner, load_train_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NO_VEL = "rlplex/CartPoleNoVel-v1"
SETTINGS: dict[str, tuple[str, float, int]] = {  # algo: (example file, target return, goal in 5 seeds)
    "sac": ("pendulum_sac.toml", -200.0, 4),
    "td3": ("pendulum_td3.toml", -200.0, 4),
    "ddpg": ("pendulum_ddpg.toml", -200.0, 0),
    "a2c": ("cartpole_a2c.toml", 475.0, 4),
    "dqn-full": ("cartpole_dqn_full.toml", 475.0, 4),
    "c51": ("cartpole_c51.toml", 475.0, 0),
    "r2d1": ("cartpole_novel_r2d1.toml", 400.0, 3),
    "ppo_lstm": ("cartpole_novel_ppo_lstm.toml", 400.0, 3),
    "ppo_ff_novel": ("cartpole_ppo.toml", 400.0, 0),
    "a2c_lstm": ("cartpole_a2c.toml", 400.0, 0),
    "r2d1_async": ("cartpole_novel_r2d1.toml", 400.0, 0),
}
RATIOS = ("replay_ratio", "min_replay_ratio")  # a floor too: the sampler waits for the optimizer
# Runs of another file's settings: algo -> (env id, budget in env steps, {section: changes}).
VARIANTS: dict[str, tuple[str, int, dict[str, dict[str, Any]]]] = {
    "ppo_ff_novel": (NO_VEL, 100_000, {}),
    # A2C's rl-zoo settings with an LSTM agent (no goal: rl-zoo has no recurrent A2C setting).
    "a2c_lstm": (NO_VEL, 500_000, {"agent": {"hidden": (64,), "lstm_size": 64}}),
    # R2D1's settings under AsyncRl, in batches of 20 steps (shorter than its 35-step sequences,
    # which run on across batches through the copiers' shared carry), at the replay ratio of
    # the example's 8 updates of 32 x 20 learned steps per 300-step batch.
    "r2d1_async": (
        NO_VEL,
        150_000,
        {"sampler": {"batch_T": 20}, "runner": {"kind": "async_eval", **dict.fromkeys(RATIOS, 8 * 32 * 20 / 300)}},
    ),
}
BASELINES = {"r2d1": "ppo_ff_novel", "ppo_lstm": "ppo_ff_novel", "a2c_lstm": "ppo_ff_novel"}  # same seeds


def run_seed(algo: str, seed: int, n_steps: int | None, stop: bool) -> dict[str, Any]:
    example, target, _ = SETTINGS[algo]
    config = load_train_config(EXAMPLES / example)
    runner_updates: dict[str, Any] = {"seed": seed, "snapshot_mode": "none", "stop_at_return": target if stop else None}
    if algo in VARIANTS:
        env_id, runner_updates["n_steps"], changes = VARIANTS[algo]
        config = override(config, "env", id=env_id)
        for section, fields in changes.items():
            if section == "runner":
                runner_updates.update(fields)
            else:
                config = override(config, section, **fields)
    if n_steps is not None:
        runner_updates["n_steps"] = n_steps
    config = override(config, "runner", **runner_updates)
    runner = build_runner(config, None, show_progress=False)
    t0 = time.perf_counter()
    result = runner.train()
    wall = time.perf_counter() - t0
    steps = [row["charts/env_steps"] for row in result.history]
    returns = [row["charts/eval_return_mean"] for row in result.history]
    reached = [s for s, r in zip(steps, returns, strict=True) if r >= target]
    return {
        "seed": seed,
        "reached": bool(reached),
        "steps_to_target": int(reached[0]) if reached else None,
        "final_eval_return": returns[-1],
        "best_eval_return": max(returns),
        "env_steps": result.env_steps,
        "wall_s": wall,
        "curve": [steps, returns],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", choices=[*sorted(SETTINGS), "all"], default="all")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 seeds")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--n-steps", type=int, default=None, help="override the example's budget")
    parser.add_argument("--no-stop", action="store_true", help="run the whole budget, past the target")
    parser.add_argument("--no-baseline", action="store_true", help="r2d1, ppo_lstm: skip the feed-forward baseline")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core per run: seeds or benchmarks can run side by side
    n_seeds = 2 if args.quick else args.seeds
    seeds = range(args.first_seed, args.first_seed + n_seeds)
    for algo in sorted(SETTINGS) if args.algo == "all" else [args.algo]:
        figures = run_algo(algo, seeds, args.n_steps, stop=not args.no_stop)
        if algo in BASELINES and args.algo != "all" and not args.no_baseline:
            baseline = run_algo(BASELINES[algo], seeds, None, stop=not args.no_stop)
            print(f"{algo}: final eval {figures['final_eval_mean']:.1f} (best {figures['best_eval_mean']:.1f}) against "
                  f"{BASELINES[algo]} {baseline['final_eval_mean']:.1f} (best {baseline['best_eval_mean']:.1f}), "
                  f"mean over seeds {list(seeds)}")  # fmt: skip


def run_algo(algo: str, seeds: range, n_steps: int | None, stop: bool) -> dict[str, Any]:
    example, target, goal = SETTINGS[algo]
    results = []
    for seed in seeds:
        res = run_seed(algo, seed, n_steps, stop)
        results.append(res)
        print(f"seed {seed}: reached={res['reached']} at={res['steps_to_target']} "
              f"final={res['final_eval_return']:.1f} wall={res['wall_s']:.0f}s", flush=True)  # fmt: skip
    passed = sum(r["reached"] for r in results)
    rows = [
        (r["seed"], str(r["reached"]), "-" if r["steps_to_target"] is None else f"{r['steps_to_target']:,}",
         f"{r['final_eval_return']:.1f}", f"{r['best_eval_return']:.1f}", f"{r['env_steps']:,}", f"{r['wall_s']:.0f}")
        for r in results
    ]  # fmt: skip
    name = f"classic_{algo.replace('-', '_')}"
    figures = {"algo": algo, "example": example, "target": target, "passed": passed, "goal": goal,
               "n_seeds": len(seeds), "seeds": results,
               "final_eval_mean": sum(r["final_eval_return"] for r in results) / len(results),
               "best_eval_mean": sum(r["best_eval_return"] for r in results) / len(results)}  # fmt: skip
    title = f"{algo.upper()} ({example}): {passed}/{len(seeds)} seeds reached {target} (goal >= {goal})"
    columns = ["seed", "reached", "steps to target", "final eval", "best eval", "env steps", "wall s"]
    report(name, title, columns, rows, figures)
    curves = {f"seed {r['seed']}": (r["curve"][0], r["curve"][1]) for r in results}
    png = plot_learning_curves(curves, RESULTS / f"{name}.png", title=f"{algo.upper()} {example} (eval)", hline=target)
    print(f"wrote {png}")
    return figures


if __name__ == "__main__":
    main()
