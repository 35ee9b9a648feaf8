"""PPO learning benchmark: does PPO reach the target evaluation return, in how many steps?

For each problem and seed, trains with `MinibatchRlEval` + `SerialSampler` from the example
TOML config (the same file `rlplex train` and `make demo` use), evaluating 10 deterministic
episodes at each log interval, and stops a seed as soon as the evaluation mean reaches the
target. After training, a fresh 10-episode evaluation (seeds unseen during training) gives
the "final" figure, so a lucky crossing is visible as such.

    python -m benchmarks.learn_ppo --env all            # the full benchmark (5 seeds)
    python -m benchmarks.learn_ppo --env cartpole --quick
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import RESULTS, TimedEvaluator, override, write_json
from rlplex.diagnostics.plots import plot_learning_curves
from rlplex.runners.config import TrainConfig, build_runner, load_train_config
from rlplex.samplers import Evaluator

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@dataclass(frozen=True)
class Problem:
    config_file: str
    target: float
    min_seeds: int  # seeds (of 5) that must reach the target
    max_steps: int = 500_000


PROBLEMS = {
    "cartpole": Problem("cartpole_ppo.toml", target=475.0, min_seeds=4),
    "pendulum": Problem("pendulum_ppo.toml", target=-300.0, min_seeds=3),
}


@dataclass
class SeedResult:
    seed: int
    reached: bool
    steps_to_target: int | None
    seconds_to_target: float | None
    env_steps: int
    wall_time_s: float
    eval_time_s: float
    last_eval: float
    final_eval: float  # fresh 10 episodes of the agent as training left it
    curve: list[tuple[int, float]] = field(default_factory=list)


def run_seed(config: TrainConfig, seed: int, target: float) -> SeedResult:
    config = override(config, "runner", seed=seed, stop_at_return=target)
    runner = build_runner(config, output_dir=None, show_progress=False)
    runner.evaluator = TimedEvaluator(config.env, config.runner.eval_episodes, seed=seed)
    t0 = time.perf_counter()
    result = runner.train()
    wall = time.perf_counter() - t0
    curve = [(int(r["charts/env_steps"]), float(r["charts/eval_return_mean"])) for r in result.history]
    fresh = Evaluator(config.env, config.runner.eval_episodes, seed=seed + 10_000)
    try:
        final = float(np.mean(fresh.evaluate(runner.agent)[0]))
    finally:
        fresh.close()
    return SeedResult(
        seed=seed,
        reached=result.target_reached_at_steps is not None,
        steps_to_target=result.target_reached_at_steps,
        seconds_to_target=result.target_reached_at_s,
        env_steps=result.env_steps,
        wall_time_s=wall,
        eval_time_s=runner.evaluator.seconds,
        last_eval=curve[-1][1] if curve else float("nan"),
        final_eval=final,
        curve=curve,
    )


def run_problem(name: str, seeds: list[int], quick: bool) -> dict[str, Any]:
    problem = PROBLEMS[name]
    config = load_train_config(EXAMPLES / problem.config_file)
    if config.runner.n_steps > problem.max_steps:
        raise SystemExit(f"{problem.config_file}: runner.n_steps {config.runner.n_steps} exceeds the benchmark budget")
    if quick:
        config = override(config, "runner", n_steps=min(config.runner.n_steps, 60_000))
    results: list[SeedResult] = []
    for seed in seeds:
        res = run_seed(config, seed, problem.target)
        results.append(res)
        print(
            f"  {name} seed {seed}: reached={res.reached} steps={res.steps_to_target} "
            f"time={res.wall_time_s:.1f}s last_eval={res.last_eval:.1f} final_eval={res.final_eval:.1f}",
            flush=True,
        )
    n_reached = sum(r.reached for r in results)
    needed = problem.min_seeds if len(seeds) == 5 else int(np.ceil(problem.min_seeds * len(seeds) / 5))
    payload: dict[str, Any] = {
        "env": config.env.id,
        "config_file": f"examples/{problem.config_file}",
        "config": config.model_dump(),
        "target": problem.target,
        "budget_steps": config.runner.n_steps,
        "quick": quick,
        "seeds_reached": n_reached,
        "seeds_needed": needed,
        "passed": n_reached >= needed,
        "seeds": [asdict(r) for r in results],
    }
    write_json(f"learn_ppo_{name}", payload)
    plot_learning_curves(
        {f"seed {r.seed}": ([p[0] for p in r.curve], [p[1] for p in r.curve]) for r in results},
        RESULTS / f"learn_ppo_{name}.png",
        title=f"PPO on {config.env.id} (deterministic eval, 10 episodes)",
        ylabel="eval return (mean of 10)",
        hline=problem.target,
    )
    print_table(name, problem, payload, results)
    return payload


def _fmt(value: float | int | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(name: str, problem: Problem, payload: dict[str, Any], results: list[SeedResult]) -> None:
    print(f"\n{payload['env']}: target {problem.target:g} within {payload['budget_steps']:,} env steps")
    head = ("seed", "reached", "steps", "seconds", "wall s", "eval s", "last", "final")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (4, 7, 9, 8, 7, 6, 8, 8), strict=True)))
    for r in results:
        print(
            f"{r.seed:>4} {r.reached!s:>7} {_fmt(r.steps_to_target, ',d'):>9} {_fmt(r.seconds_to_target, '.1f'):>8} "
            f"{r.wall_time_s:>7.1f} {r.eval_time_s:>6.1f} {r.last_eval:>8.1f} {r.final_eval:>8.1f}"
        )
    verdict = "PASS" if payload["passed"] else "FAIL"
    reached, needed = payload["seeds_reached"], payload["seeds_needed"]
    print(f"{name}: {reached}/{len(results)} seeds reached (need {needed}): {verdict}")
    print(f"wrote {RESULTS / f'learn_ppo_{name}.json'} and .png\n", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", choices=[*PROBLEMS, "all"], default="all")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default 0..4; --quick: 0 1)")
    parser.add_argument("--quick", action="store_true", help="2 seeds and at most 60k steps each")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    seeds = args.seeds if args.seeds is not None else ([0, 1] if args.quick else [0, 1, 2, 3, 4])
    names = list(PROBLEMS) if args.env == "all" else [args.env]
    for name in names:
        run_problem(name, seeds, args.quick)


if __name__ == "__main__":
    main()
