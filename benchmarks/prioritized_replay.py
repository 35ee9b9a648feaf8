"""Prioritized replay at 1M capacity: sample 256 transitions and update their 256 priorities.

    python -m benchmarks.prioritized_replay [--quick] [--capacity N] [--iters N]

The replay holds CartPole-sized transitions (4 floats per observation), is filled to capacity
and given random priorities first, so the sum-tree is full and uneven (20 levels at 1M).
Timed one call (or pair) at a time, median, p90 and p99 over the iterations, wall-clock and
this thread's CPU time (on a loaded machine the wall-clock p99 is the scheduler's time slice,
not the replay's): the prioritized sample (tree descent, importance weights, the
transitions' copy) alone, `update_priorities` alone, and the pair (the goal), with one-step
and 3-step transitions, in ordinary memory and in shared memory behind the multiprocessing
lock (as under AsyncRl). The uniform sample is timed alongside for scale.

Goal (issue 15): sample(256) + update_priorities(256) at 1M capacity in under 1 ms.
Prints a table, writes bench_results/prioritized_replay.json.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from benchmarks.common import report
from rlplex.envs import EnvSpaces
from rlplex.processes import CONTEXT
from rlplex.replays import PrioritizedReplayBuffer, UniformReplayBuffer

SPACES = EnvSpaces(obs_shape=(4,), action_kind="discrete", n_actions=2, action_shape=())
BATCH = 256
GOAL_US = 1000.0


def fill(buffer: UniformReplayBuffer, capacity: int, rng: np.random.Generator) -> None:
    chunk, B = 65_536, 8  # time-major [T, 8] appends, like a sampler's
    for start in range(0, capacity, chunk):
        n = min(chunk, capacity - start)
        T = max(1, n // B)
        obs = rng.normal(size=(T + 1, B, 4)).astype(np.float32)
        buffer.append_samples({
            "observation": obs[:-1], "action": rng.integers(0, 2, size=(T, B)), "reward": np.ones((T, B), np.float32),
            "next_observation": obs[1:], "terminated": rng.random((T, B)) < 0.02,
        })  # fmt: skip
        if isinstance(buffer, PrioritizedReplayBuffer):
            idx = (buffer.cursor - T * B + np.arange(T * B)) % capacity
            buffer.update_priorities(idx, rng.random(T * B) ** 0.6 + 1e-6)


def sample_and_update(per: PrioritizedReplayBuffer, rng: np.random.Generator, n_step: int, new: np.ndarray) -> None:
    batch = per.sample(BATCH, rng, n_step, 0.99, beta=0.4)
    per.update_priorities(batch["index"], new)


def timed(fn: Callable[[], object], iters: int) -> dict[str, float]:
    """Median, p90 and p99 of one call in µs, wall-clock and this thread's CPU time (which a
    busy machine's scheduler does not inflate: a preempted call's wall time holds the time slice
    of whoever ran meanwhile)."""
    for _ in range(min(100, iters)):
        fn()
    wall, cpu = np.empty(iters), np.empty(iters)
    for i in range(iters):
        c0, t0 = time.thread_time(), time.perf_counter()
        fn()
        wall[i], cpu[i] = time.perf_counter() - t0, time.thread_time() - c0
    median, p90, p99 = np.percentile(wall, [50, 90, 99]) * 1e6
    cpu_median, cpu_p99 = np.percentile(cpu, [50, 99]) * 1e6
    return {"median_us": float(median), "p90_us": float(p90), "p99_us": float(p99),
            "cpu_median_us": float(cpu_median), "cpu_p99_us": float(cpu_p99)}  # fmt: skip


def row_times(t: dict[str, float]) -> tuple[float, ...]:
    return t["median_us"], t["p90_us"], t["p99_us"], t["cpu_median_us"], t["cpu_p99_us"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacity", type=int, default=1_000_000)
    parser.add_argument("--iters", type=int, default=3000)
    parser.add_argument("--quick", action="store_true", help="500 iterations")
    args = parser.parse_args()
    iters = 500 if args.quick else args.iters
    load_before = os.getloadavg()
    rows: list[tuple[object, ...]] = []
    figures: dict[str, Any] = {}
    rng = np.random.default_rng(0)
    uniform = UniformReplayBuffer.create(SPACES, args.capacity)
    fill(uniform, args.capacity, rng)
    for shared in (False, True):
        per = PrioritizedReplayBuffer.create(
            SPACES, args.capacity, shared=shared, lock=CONTEXT.Lock() if shared else None
        )
        try:
            fill(per, args.capacity, rng)
            memory = "shared+lock" if shared else "ordinary"
            for n_step in (1, 3):
                draw = np.random.default_rng(1)
                index = per.sample(BATCH, draw, n_step, 0.99, beta=0.4)["index"]
                new = draw.random(BATCH) + 1e-6
                calls = {
                    "sample": partial(per.sample, BATCH, draw, n_step, 0.99, beta=0.4),
                    "update_priorities": partial(per.update_priorities, index, new),
                    "sample + update": partial(sample_and_update, per, draw, n_step, new),
                }
                for what, fn in calls.items():
                    t = figures[f"{what} n_step={n_step} {memory}"] = timed(fn, iters)
                    goal = ("yes" if t["median_us"] < GOAL_US else "NO") if what == "sample + update" else ""
                    rows.append((what, n_step, memory, *row_times(t), goal))
        finally:
            per.close()
    for n_step in (1, 3):
        draw = np.random.default_rng(2)
        t = figures[f"uniform sample n_step={n_step}"] = timed(
            partial(uniform.sample, BATCH, draw, n_step, 0.99), iters
        )
        rows.append(("uniform sample (scale)", n_step, "ordinary", *row_times(t), ""))
    uniform.close()
    figures.update(capacity=args.capacity, batch=BATCH, iters=iters, goal_us=GOAL_US,
                   load_avg_before=load_before, load_avg_after=os.getloadavg())  # fmt: skip
    title = f"prioritized replay, capacity {args.capacity:,}, batch {BATCH} (goal: sample + update < 1 ms)"
    columns = ["call", "n", "memory", "median µs", "p90 µs", "p99 µs", "CPU p50", "CPU p99", "< 1 ms"]
    report("prioritized_replay", title, columns, rows, figures)
    print(f"load average before {load_before}, after {os.getloadavg()}")


if __name__ == "__main__":
    main()
