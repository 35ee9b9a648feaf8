"""DQN env steps/s: AsyncRl against MinibatchRl when sampling and optimization cost the same.

First calibrates, in this process, the time of one 256-step sampler batch and of one
gradient step, and picks the updates per batch that make them equal; both runners then use
that same replay ratio. MinibatchRl alternates the two; AsyncRl overlaps them in two
processes, so up to 2x on two free cores. AsyncRl's time starts at its first batch
(process start-up excluded) and its achieved ratio is reported beside the set point.

    python -m benchmarks.async_vs_minibatch [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

import torch

from rlplex.agents import DqnAgent
from rlplex.algos import DQN, DQNConfig
from rlplex.envs import EnvConfig, probe_spaces
from rlplex.runners import AsyncRl, MinibatchRl
from rlplex.samplers import SerialSampler

OUT = Path("bench_results")
CARTPOLE = EnvConfig(id="CartPole-v1")
T, B, HIDDEN, BATCH = 64, 4, (64, 64), 64


def calibrate() -> int:
    torch.set_num_threads(1)
    spaces = probe_spaces(CARTPOLE)
    agent = DqnAgent(spaces, hidden=HIDDEN)
    algo = DQN(DQNConfig(batch_size=BATCH, learning_starts=0), seed=0)
    algo.initialize(agent, n_itr=100)
    sampler = SerialSampler(CARTPOLE, T, B)
    sampler.initialize(agent, seed=0)
    samples = sampler.obtain_samples(0)
    algo.optimize_agent(0, samples, n_updates=20)  # warm-up
    t0 = time.perf_counter()
    for itr in range(10):
        sampler.obtain_samples(itr)
    sample_s = (time.perf_counter() - t0) / 10
    t0 = time.perf_counter()
    algo.optimize_agent(1, None, n_updates=200)
    update_s = (time.perf_counter() - t0) / 200
    sampler.shutdown()
    print(f"calibration: {sample_s * 1e3:.1f} ms per {T * B}-step batch, {update_s * 1e3:.2f} ms per update")
    return max(1, round(sample_s / update_s))


def config(updates: int) -> DQNConfig:
    return DQNConfig(batch_size=BATCH, learning_starts=1000, updates_per_itr=updates, target_update_interval=updates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n_steps = 20_480 if args.quick else 81_920
    updates = calibrate()
    ratio = updates * BATCH / (T * B)
    minibatch = MinibatchRl(
        DQN(config(updates), seed=0), DqnAgent(probe_spaces(CARTPOLE), hidden=HIDDEN), SerialSampler(CARTPOLE, T, B),
        n_steps=n_steps, seed=0, log_interval_steps=n_steps, snapshot_mode="none", show_progress=False,
    )  # fmt: skip
    mb = minibatch.train()
    run = AsyncRl(
        DQN(config(updates), seed=0), partial(DqnAgent, hidden=HIDDEN), CARTPOLE, batch_T=T, batch_B=B,
        n_steps=n_steps, replay_ratio=ratio, seed=0, log_interval_steps=n_steps // 4, show_progress=False,
    )  # fmt: skip
    asy = run.train()
    mb_rate, asy_rate = mb.env_steps / mb.wall_time_s, asy.env_steps / asy.wall_time_s
    achieved = asy.history[-1]["charts/replay_ratio_cumulative"]
    speedup = asy_rate / mb_rate
    print(f"\nupdates per {T * B}-step batch: {updates} (replay ratio {ratio:g})")
    print(f"{'runner':>11} {'env steps/s':>12} {'wall s':>8} {'replay ratio':>13}")
    print(f"{'MinibatchRl':>11} {mb_rate:>12.0f} {mb.wall_time_s:>8.1f} {ratio:>13.3f}")
    print(f"{'AsyncRl':>11} {asy_rate:>12.0f} {asy.wall_time_s:>8.1f} {achieved:>13.3f}")
    print(f"\nspeed-up {speedup:.2f}x (goal >= 1.6x)")
    OUT.mkdir(exist_ok=True)
    summary = {
        "updates_per_batch": updates,
        "replay_ratio_set_point": ratio,
        "minibatch_env_steps_per_s": mb_rate,
        "async_env_steps_per_s": asy_rate,
        "async_achieved_replay_ratio": achieved,
        "speedup": speedup,
        "n_steps": n_steps,
    }
    (OUT / "async_vs_minibatch.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
