"""Wall time for PPO to reach evaluation return 475 on CartPole-v1: rlplex beside Stable-Baselines3.

SB3 runs the rl-zoo CartPole-v1 settings (8 DummyVecEnv envs, n_steps 32, batch 256,
gae 0.8, gamma 0.98, 20 epochs, linear lr 1e-3 and clip 0.2, MlpPolicy, cpu). rlplex runs
ITS OWN CONFIG, `examples/cartpole_ppo.toml` (or `--rlplex-config`), which is rl-zoo's
settings with twice the learning rate (2e-3); so the default comparison is of the two
libraries as shipped, not of the same hyperparameters. `--same-settings` runs rlplex with
exactly SB3's settings instead (lr 1e-3), for the like-for-like figure. Both use one torch
thread, the same seeds and the same evaluation: rlplex's `Evaluator` (10 deterministic
episodes on the same evaluation seeds) every `--eval-every` env steps, after the update.
Evaluation time is EXCLUDED from the headline times of both (it is reported separately, and
the times with it included are in the JSON). Runs alternate rlplex / SB3 per seed so that
machine noise hits both. Times include building the envs and the model. Ten seeds by default:
the env steps each library needs vary two- to threefold from seed to seed, so the median ratio
of five seeds moves by more than the per-step speed-up does.

    python -m benchmarks.ppo_vs_sb3                     # 10 seeds, rlplex's own config
    python -m benchmarks.ppo_vs_sb3 --same-settings     # 10 seeds, rlplex with SB3's settings
    python -m benchmarks.ppo_vs_sb3 --quick             # 1 seed
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import ZOO_CARTPOLE_PPO, TimedEvaluator, override, write_json
from rlplex.runners.config import TrainConfig, build_runner, load_train_config

TARGET = 475.0
ENV_ID = "CartPole-v1"
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "examples" / "cartpole_ppo.toml"
SB3_ZOO = dict(
    n_steps=32,
    batch_size=256,
    gae_lambda=0.8,
    gamma=0.98,
    n_epochs=20,
    ent_coef=0.0,
)
SB3_N_ENVS = 8
RLPLEX_SAME_AS_SB3 = ZOO_CARTPOLE_PPO  # SB3_ZOO (+ 8 envs, linear lr 1e-3 and clip 0.2) in rlplex's terms


@dataclass
class Run:
    library: str
    seed: int
    reached: bool
    steps: int  # env steps at the evaluation that reached the target (or at the end)
    train_s: float  # wall time excluding evaluation
    eval_s: float
    total_s: float  # wall time including evaluation


def rlplex_config(config_path: Path, same_settings: bool) -> TrainConfig:
    config = load_train_config(config_path)
    if same_settings:
        for section, updates in RLPLEX_SAME_AS_SB3.items():
            config = override(config, section, **updates)
    return config


def run_rlplex(config: TrainConfig, seed: int, eval_every: int, budget: int) -> Run:
    config = override(config, "runner", seed=seed, stop_at_return=TARGET, log_interval_steps=eval_every, n_steps=budget)
    t0 = time.perf_counter()
    runner = build_runner(config, output_dir=None, show_progress=False)
    runner.evaluator = TimedEvaluator(config.env, 10, seed=seed)
    result = runner.train()
    total = time.perf_counter() - t0
    eval_s = runner.evaluator.seconds
    reached = result.target_reached_at_steps is not None
    steps = result.target_reached_at_steps if reached else result.env_steps
    return Run("rlplex", seed, reached, int(steps or 0), total - eval_s, eval_s, total)


class _Sb3EvalAgent:
    """Lets rlplex's `Evaluator` drive an SB3 policy, so both libraries share one evaluation."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def eval_step(self, observation: np.ndarray) -> np.ndarray:
        action, _ = self.model.predict(observation, deterministic=True)
        return np.asarray(action)


def run_sb3(seed: int, eval_every: int, budget: int) -> Run:
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.utils import LinearSchedule
    from stable_baselines3.common.vec_env import DummyVecEnv

    from rlplex.envs import EnvConfig

    evaluator = TimedEvaluator(EnvConfig(id=ENV_ID), 10, seed=seed)

    class EvalStop(BaseCallback):
        """Evaluates at the start of a rollout (i.e. after the previous update), like the rlplex runner."""

        def __init__(self) -> None:
            super().__init__()
            self.next_eval = eval_every
            self.reached_at: int | None = None

        def _on_rollout_start(self) -> None:
            if self.reached_at is None and self.num_timesteps >= self.next_eval:
                self.next_eval += eval_every
                returns, _ = evaluator.evaluate(_Sb3EvalAgent(self.model))  # type: ignore[arg-type]
                if float(np.mean(returns)) >= TARGET:
                    self.reached_at = self.num_timesteps

        def _on_step(self) -> bool:
            return self.reached_at is None

    callback = EvalStop()
    t0 = time.perf_counter()
    env = make_vec_env(ENV_ID, n_envs=SB3_N_ENVS, seed=seed, vec_env_cls=DummyVecEnv)
    model = PPO(
        "MlpPolicy",
        env,
        learning_rate=LinearSchedule(1e-3, 0.0, 1.0),
        clip_range=LinearSchedule(0.2, 0.0, 1.0),
        device="cpu",
        seed=seed,
        verbose=0,
        **SB3_ZOO,  # type: ignore[arg-type]
    )
    model.learn(total_timesteps=budget, callback=callback)
    total = time.perf_counter() - t0
    env.close()
    evaluator.close()
    reached = callback.reached_at is not None
    steps = callback.reached_at if callback.reached_at is not None else model.num_timesteps
    return Run("sb3", seed, reached, int(steps), total - evaluator.seconds, evaluator.seconds, total)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0-9 (--quick: 0)")
    parser.add_argument("--eval-every", type=int, default=2048, help="env steps between evaluations (both)")
    parser.add_argument("--budget", type=int, default=200_000, help="env steps at most (both; sets the schedules)")
    parser.add_argument("--rlplex-config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--same-settings", action="store_true", help="rlplex runs SB3's (rl-zoo's) settings")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    # The first Adam of a process imports torch._dynamo (about a second). SB3 pays it in its
    # constructor and rlplex in its timed start-up; paying it here keeps it out of both.
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else list(range(10)))

    config = rlplex_config(args.rlplex_config, args.same_settings)
    lr = float(getattr(config.algo, "learning_rate", float("nan")))
    settings = (
        f"rlplex: SB3's rl-zoo settings (lr {lr:g})"
        if args.same_settings
        else f"rlplex: its own config {args.rlplex_config.name} (lr {lr:g})"
    )
    settings += "; SB3: rl-zoo CartPole-v1 settings (lr 0.001)"
    print(settings, flush=True)
    runs: list[tuple[Run, Run]] = []
    for seed in seeds:
        ours = run_rlplex(config, seed, args.eval_every, args.budget)
        print(f"  seed {seed} rlplex: {ours.train_s:.2f}s, {ours.steps} steps, reached={ours.reached}", flush=True)
        theirs = run_sb3(seed, args.eval_every, args.budget)
        print(f"  seed {seed} sb3:    {theirs.train_s:.2f}s train, {theirs.steps} steps, reached={theirs.reached}")
        runs.append((ours, theirs))

    print(f"\nPPO to eval return >= {TARGET:g} on {ENV_ID} (times exclude evaluation; torch 1 thread)")
    print(settings)
    print(
        f"{'seed':>4} {'rlplex s':>9} {'rlplex steps':>12} {'sb3 s':>8} {'sb3 steps':>10} {'sb3/rlplex':>10}"
        f" {'rlplex us/step':>14} {'sb3 us/step':>11}"
    )
    ratios: list[float] = []
    per_step_ratios: list[float] = []
    for ours, theirs in runs:
        ok = ours.reached and theirs.reached
        ratio = theirs.train_s / ours.train_s if ok else float("nan")
        ours_us, theirs_us = 1e6 * ours.train_s / max(ours.steps, 1), 1e6 * theirs.train_s / max(theirs.steps, 1)
        per_step_ratios.append(theirs_us / ours_us)
        if ok:
            ratios.append(ratio)
        print(
            f"{ours.seed:>4} {ours.train_s:>9.2f} {ours.steps:>12,} {theirs.train_s:>8.2f} {theirs.steps:>10,} "
            f"{ratio:>10.2f} {ours_us:>14.0f} {theirs_us:>11.0f}" + ("" if ok else "  (a run did not reach the target)")
        )
    median = statistics.median(ratios) if ratios else float("nan")
    per_step = statistics.median(per_step_ratios)
    print(f"median speed-up (SB3 time / rlplex time): {median:.2f}x  (goal >= 2)")
    print(f"median per-step speed-up (wall time per env step, start-up included): {per_step:.2f}x")
    path = write_json(
        "ppo_vs_sb3_same_settings" if args.same_settings else "ppo_vs_sb3",
        {
            "env": ENV_ID,
            "target": TARGET,
            "eval_every_steps": args.eval_every,
            "eval_episodes": 10,
            "eval_time": "excluded from train_s, included in total_s",
            "budget_steps": args.budget,
            "rlplex_settings": "same as sb3 (rl-zoo)" if args.same_settings else "own config",
            "rlplex_config": config.model_dump(),
            "rlplex_config_file": str(args.rlplex_config),
            "sb3_settings": {**SB3_ZOO, "n_envs": SB3_N_ENVS, "learning_rate": "lin_1e-3", "clip_range": "lin_0.2"},
            "runs": [{"rlplex": asdict(o), "sb3": asdict(t)} for o, t in runs],
            "ratios": ratios,
            "median_ratio": median,
            "per_step_ratios": per_step_ratios,
            "median_per_step_ratio": per_step,
            "goal_met": bool(ratios) and median >= 2.0,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
