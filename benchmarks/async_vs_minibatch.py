"""DQN env steps/s: AsyncRl against MinibatchRl when sampling and optimization cost the same.

First calibrates, in this process, the time of one 256-step sampler batch and of one
gradient step, and picks the updates per batch that make them equal; both runners then use
that same replay ratio. MinibatchRl alternates the two; AsyncRl overlaps them in two
processes, so up to 2x on two free cores. AsyncRl's time starts at its first batch
(process start-up excluded) and its achieved ratio is reported beside the set point.

A third run per seed, AsyncRl with the parallel sampler behind the double buffer
(`[sampler] kind = "parallel"`, `--workers` processes stepping the environments and running
the agent), shows what sampling workers add when there are cores for them (on two cores the
optimizer, the sampler process and the workers share them).

    python -m benchmarks.async_vs_minibatch [--quick] [--repeats 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def run_set(updates: int, n_steps: int, seed: int, workers: int) -> tuple[float, float, float, float, float]:
    """(MinibatchRl env steps/s, AsyncRl env steps/s and achieved replay ratio, the same for
    AsyncRl with `workers` parallel sampler workers), back to back."""
    ratio = updates * BATCH / (T * B)
    minibatch = MinibatchRl(
        DQN(config(updates), seed=seed), DqnAgent(probe_spaces(CARTPOLE), hidden=HIDDEN),
        SerialSampler(CARTPOLE, T, B), n_steps=n_steps, seed=seed, log_interval_steps=n_steps, snapshot_mode="none",
        show_progress=False,
    )  # fmt: skip
    mb = minibatch.train()
    rates = []
    for n_workers in (None, workers):
        run = AsyncRl(
            DQN(config(updates), seed=seed), partial(DqnAgent, hidden=HIDDEN), CARTPOLE, batch_T=T, batch_B=B,
            n_steps=n_steps, replay_ratio=ratio, seed=seed, log_interval_steps=n_steps // 4, show_progress=False,
            n_workers=n_workers,
        )  # fmt: skip
        asy = run.train()
        rates += [asy.env_steps / asy.wall_time_s, float(asy.history[-1]["charts/replay_ratio_cumulative"])]
    return mb.env_steps / mb.wall_time_s, rates[0], rates[1], rates[2], rates[3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="sets run back to back; the median ratio is quoted")
    parser.add_argument("--workers", type=int, default=2, help="parallel sampler workers of the third run")
    args = parser.parse_args()
    n_steps = 20_480 if args.quick else 81_920
    repeats = 1 if args.quick else args.repeats
    updates = calibrate()
    ratio = updates * BATCH / (T * B)
    sets = [run_set(updates, n_steps, seed, args.workers) for seed in range(repeats)]
    speedups = [asy / mb for mb, asy, _, _, _ in sets]
    parallel_speedups = [par / mb for mb, _, _, par, _ in sets]
    speedup, parallel_speedup = statistics.median(speedups), statistics.median(parallel_speedups)
    print(f"\nupdates per {T * B}-step batch: {updates} (replay ratio set point {ratio:g})")
    print(f"{'seed':>4} {'MinibatchRl':>12} {'AsyncRl':>9} {'ratio':>6} {'speed-up':>9} "
          f"{f'AsyncRl+{args.workers}w':>11} {'ratio':>6} {'speed-up':>9}   (env steps/s)")  # fmt: skip
    for seed, ((mb_rate, asy_rate, achieved, par_rate, par_achieved), up, par_up) in enumerate(
        zip(sets, speedups, parallel_speedups, strict=True)
    ):
        print(f"{seed:>4} {mb_rate:>12.0f} {asy_rate:>9.0f} {achieved:>6.3f} {up:>8.2f}x "
              f"{par_rate:>11.0f} {par_achieved:>6.3f} {par_up:>8.2f}x")  # fmt: skip
    print(
        f"\nmedian speed-up {speedup:.2f}x (goal >= 1.6x); with {args.workers} sampler workers {parallel_speedup:.2f}x"
    )
    OUT.mkdir(exist_ok=True)
    summary = {
        "updates_per_batch": updates,
        "replay_ratio_set_point": ratio,
        "n_steps": n_steps,
        "parallel_workers": args.workers,
        "runs": [
            {
                "seed": i,
                "minibatch_env_steps_per_s": m,
                "async_env_steps_per_s": a,
                "async_achieved_replay_ratio": r,
                "async_parallel_env_steps_per_s": p,
                "async_parallel_achieved_replay_ratio": pr,
            }
            for i, (m, a, r, p, pr) in enumerate(sets)
        ],
        "speedups": speedups,
        "speedup": speedup,
        "parallel_speedups": parallel_speedups,
        "parallel_speedup": parallel_speedup,
        "goal_met": speedup >= 1.6,
    }
    (OUT / "async_vs_minibatch.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
