"""Seconds per SAC gradient step: rlplex beside Stable-Baselines3, side by side in one run.

    python -m benchmarks.sac_update [--quick] [--steps N] [--threads T]

Both get the same problem: HalfCheetah's sizes (17-dim observations, 6-dim actions in
[-1, 1]), 256x256 actor and twin critics, batch 256, automatic entropy tuning, a replay of
10k random transitions, torch on the CPU with `--threads` intra-op threads (default 1). Each
timed call is ONE gradient step as each library's training loop makes it once per env step
(`train_freq = gradient_steps = 1`): SB3's `SAC.train(gradient_steps=1, batch_size=256)`,
rlplex's `SAC.optimize_agent(itr, None, n_updates=1)` (replay sampling, the update, the
metrics). The two alternate in rounds so that machine noise hits both; the median round is
reported, as wall time and as the CPU time of the (single) thread, which other processes on a
shared machine disturb less. Goal (issue 15): rlplex <= 0.7x SB3's time.
Writes bench_results/sac_update.json.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import gymnasium as gym
import numpy as np
import torch

from benchmarks.common import alternate_rounds, report, round_options, silent_sb3_with_replay
from rlplex.agents import SacAgent
from rlplex.algos.sac import SAC, SACConfig
from rlplex.envs import EnvSpaces

OBS_DIM, ACTION_DIM, BATCH, FILL = 17, 6, 256, 10_000
GOAL = 0.7


def random_transitions(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "observation": rng.standard_normal((n, OBS_DIM)).astype(np.float32),
        "action": rng.uniform(-1, 1, (n, ACTION_DIM)).astype(np.float32),
        "reward": rng.standard_normal(n).astype(np.float32),
        "next_observation": rng.standard_normal((n, OBS_DIM)).astype(np.float32),
        "terminated": rng.random(n) < 0.01,
    }


def rlplex_step() -> Callable[[], None]:
    spaces = EnvSpaces((OBS_DIM,), "continuous", 0, (ACTION_DIM,), (-1.0,) * ACTION_DIM, (1.0,) * ACTION_DIM)
    algo = SAC(SACConfig(batch_size=BATCH, learning_starts=0, buffer_size=FILL), seed=0)
    algo.initialize(SacAgent(spaces, hidden=(256, 256)), n_itr=1)
    data = random_transitions(FILL, 0)
    assert algo.replay is not None
    algo.replay.append_samples({**data, "done": data["terminated"]})
    itr = iter(range(10**9))
    return lambda: algo.optimize_agent(next(itr), None, n_updates=1) and None


class _Spec(gym.Env[np.ndarray, np.ndarray]):
    """Only the spaces, for SB3's constructor; no step is ever taken."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (OBS_DIM,), np.float32)
    action_space = gym.spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32)


def sb3_step() -> Callable[[], None]:
    from stable_baselines3 import SAC as Sb3SAC

    model = Sb3SAC("MlpPolicy", _Spec(), batch_size=BATCH, buffer_size=FILL, learning_starts=0, device="cpu", seed=0)
    silent_sb3_with_replay(model, random_transitions(FILL, 0))
    return lambda: model.train(gradient_steps=1, batch_size=BATCH)


def main() -> None:
    steps, rounds, threads = round_options(__doc__ or "", 50, 200)
    contenders = {"rlplex": rlplex_step(), "sb3": sb3_step()}
    timed = alternate_rounds(contenders, steps, rounds)
    wall, cpu = timed["wall_seconds_per_call"], timed["cpu_seconds_per_call"]
    median, median_cpu = timed["median_wall"], timed["median_cpu"]
    ratio, ratio_cpu = median["rlplex"] / median["sb3"], median_cpu["rlplex"] / median_cpu["sb3"]
    rows: list[tuple[object, ...]] = [
        (name, median[name] * 1e3, median_cpu[name] * 1e3, min(wall[name]) * 1e3) for name in contenders
    ]
    rows.append(("rlplex / sb3", ratio, ratio_cpu, min(wall["rlplex"]) / min(wall["sb3"])))
    report(
        "sac_update",
        f"SAC gradient step, obs {OBS_DIM} / action {ACTION_DIM}, batch {BATCH}, 256x256, "
        f"{threads} thread(s), median of {rounds} rounds x {steps} steps (goal rlplex / sb3 <= {GOAL})",
        ["contender", "wall ms / step", "CPU ms / step", "wall ms, best round"],
        rows,
        {
            "obs_dim": OBS_DIM,
            "action_dim": ACTION_DIM,
            "batch_size": BATCH,
            "hidden": [256, 256],
            "threads": threads,
            "rounds": rounds,
            "steps_per_round": steps,
            "wall_seconds_per_step": wall,
            "cpu_seconds_per_step": cpu,
            "median_wall_seconds_per_step": median,
            "median_cpu_seconds_per_step": median_cpu,
            "ratio_rlplex_to_sb3": ratio,
            "ratio_rlplex_to_sb3_cpu": ratio_cpu,
            "load_average": os.getloadavg(),
            "goal_ratio": GOAL,
            "torch": torch.__version__,
        },
    )


if __name__ == "__main__":
    main()
