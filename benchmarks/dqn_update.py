"""Seconds per DQN gradient step: rlplex beside Stable-Baselines3, side by side in one run.

    python -m benchmarks.dqn_update [--quick] [--steps N] [--rounds R] [--threads T]

Both get rl-zoo's CartPole-v1 DQN problem: 4-dim observations, 2 actions, a 256x256
Q-network, batch 64, a replay of 10k random transitions, torch on the CPU with `--threads`
intra-op threads (default 1). Each timed call is ONE gradient step (replay sampling, the
double-DQN target, the update, the target copy when due): SB3's `DQN.train(gradient_steps=1,
batch_size=64)` (its target without double Q, as SB3 has it) and rlplex's
`DQN.optimize_agent(itr, None, n_updates=1)`. A third contender is rlplex with torch's
per-parameter Adam instead of the fused one every rlplex algorithm builds (`adam` in
`rlplex.algos.optim_state`), to show what fusing is worth. The contenders alternate in rounds;
the median round is reported, as wall time and as the CPU time of the single thread.
Writes bench_results/dqn_update.json.
"""

from __future__ import annotations

import os

import gymnasium as gym
import numpy as np
import torch

from benchmarks.common import alternate_rounds, report, round_options, silent_sb3_with_replay
from rlplex.agents import DqnAgent
from rlplex.algos import DQN, DQNConfig
from rlplex.envs import EnvSpaces

OBS_DIM, N_ACTIONS, BATCH, FILL, HIDDEN = 4, 2, 64, 10_000, (256, 256)


def random_transitions(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "observation": rng.standard_normal((n, OBS_DIM)).astype(np.float32),
        "action": rng.integers(0, N_ACTIONS, n),
        "reward": np.ones(n, dtype=np.float32),
        "next_observation": rng.standard_normal((n, OBS_DIM)).astype(np.float32),
        "terminated": rng.random(n) < 0.05,
    }


def rlplex_step(fused: bool = True) -> DQN:
    spaces = EnvSpaces((OBS_DIM,), "discrete", N_ACTIONS, ())
    algo = DQN(DQNConfig(batch_size=BATCH, learning_starts=0, buffer_size=FILL, target_update_interval=10), seed=0)
    algo.initialize(DqnAgent(spaces, hidden=HIDDEN), n_itr=1)
    if not fused:
        assert algo.agent is not None
        algo.optimizer = torch.optim.Adam(algo.agent.model.parameters(), lr=algo.config.learning_rate, foreach=False)
    data = random_transitions(FILL, 0)
    assert algo.replay is not None
    algo.replay.append_samples({**data, "done": data["terminated"]})
    return algo


class _Spec(gym.Env[np.ndarray, int]):
    """Only the spaces, for SB3's constructor; no step is ever taken."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (OBS_DIM,), np.float32)
    action_space = gym.spaces.Discrete(N_ACTIONS)


def sb3_model() -> object:
    from stable_baselines3 import DQN as Sb3DQN

    model = Sb3DQN(
        "MlpPolicy",
        _Spec(),
        batch_size=BATCH,
        buffer_size=FILL,
        learning_starts=0,
        target_update_interval=10,
        policy_kwargs={"net_arch": list(HIDDEN)},
        device="cpu",
        seed=0,
    )
    return silent_sb3_with_replay(model, random_transitions(FILL, 0))


def main() -> None:
    steps, rounds, threads = round_options(__doc__ or "", 100, 500)
    fused, loop, sb3 = rlplex_step(), rlplex_step(fused=False), sb3_model()
    counters = {"fused": iter(range(10**9)), "loop": iter(range(10**9))}
    contenders = {
        "rlplex": lambda: fused.optimize_agent(next(counters["fused"]), None, n_updates=1),
        "rlplex, per-parameter Adam": lambda: loop.optimize_agent(next(counters["loop"]), None, n_updates=1),
        "sb3": lambda: sb3.train(gradient_steps=1, batch_size=BATCH),  # type: ignore[attr-defined]
    }
    timed = alternate_rounds(contenders, steps, rounds)
    wall, cpu = timed["median_wall"], timed["median_cpu"]
    rows: list[tuple[object, ...]] = [(name, wall[name] * 1e3, cpu[name] * 1e3) for name in contenders]
    rows.append(("rlplex / sb3", wall["rlplex"] / wall["sb3"], cpu["rlplex"] / cpu["sb3"]))
    fused_gain = wall["rlplex, per-parameter Adam"] / wall["rlplex"]
    rows.append(("per-parameter / fused Adam", fused_gain, cpu["rlplex, per-parameter Adam"] / cpu["rlplex"]))
    report(
        "dqn_update",
        f"DQN gradient step, obs {OBS_DIM} / {N_ACTIONS} actions, batch {BATCH}, {HIDDEN[0]}x{HIDDEN[1]}, "
        f"{threads} thread(s), median of {rounds} rounds x {steps} steps",
        ["contender", "wall ms / step", "CPU ms / step"],
        rows,
        {
            "obs_dim": OBS_DIM,
            "n_actions": N_ACTIONS,
            "batch_size": BATCH,
            "hidden": list(HIDDEN),
            "threads": threads,
            "rounds": rounds,
            "steps_per_round": steps,
            **timed,
            "ratio_rlplex_to_sb3": wall["rlplex"] / wall["sb3"],
            "ratio_per_parameter_to_fused_adam": fused_gain,
            "load_average": os.getloadavg(),
            "torch": torch.__version__,
        },
    )


if __name__ == "__main__":
    main()
