"""SyncRl(W) against MinibatchRl on CartPole PPO, with the same per-rank batch.

    python -m benchmarks.sync_scaling [--quick] [--world-size 2]

Both runs use rl-zoo's CartPole PPO settings (`ZOO_CARTPOLE_PPO`) with `kind = "minibatch"` / `"sync"`
and the same `batch_T x batch_B` per rank, so SyncRl(W) samples W times as many steps per
iteration (batch sizes are per rank). Steps/s counts the steps of all ranks over the
training loop; "wall" adds process start-up. On a machine with fewer free cores than ranks
the ranks share cores, so the speed-up is bounded by the free cores, not by W.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

from benchmarks.common import ZOO_CARTPOLE_PPO, report
from rlplex.runners.config import TrainConfig, build_runner


def config(kind: str, n_steps: int, world_size: int) -> TrainConfig:
    return TrainConfig.model_validate(
        {
            "env": {"id": "CartPole-v1"},
            "sampler": ZOO_CARTPOLE_PPO["sampler"],
            "algo": {"name": "ppo", **ZOO_CARTPOLE_PPO["algo"]},
            "runner": {
                "kind": kind,
                "n_steps": n_steps,
                "log_interval_steps": 2048,
                "world_size": world_size,
            },
        }
    )


def run(kind: str, n_steps: int, world_size: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        result = build_runner(config(kind, n_steps, world_size), out, show_progress=False).train()
        wall = time.perf_counter() - t0
    returns = [row["charts/online_return_mean"] for row in result.history if "charts/online_return_mean" in row]
    return {
        "runner": "MinibatchRl" if kind == "minibatch" else f"SyncRl({world_size})",
        "env_steps": result.env_steps,
        "train_s": result.wall_time_s,
        "wall_s": wall,
        "steps_per_s": result.env_steps / result.wall_time_s,
        "final_return": returns[-1] if returns else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short run (16k steps per rank)")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    per_rank = 16_384 if args.quick else 65_536
    runs = [run("minibatch", per_rank, 1), run("sync", per_rank * args.world_size, args.world_size)]
    columns = list(runs[0])
    report(
        "sync_scaling",
        f"CartPole PPO, {per_rank} steps per rank, batch 32 x 8 per rank",
        columns,
        [[r[c] for c in columns] for r in runs],
        {"per_rank_steps": per_rank, "runs": runs, "speedup": runs[1]["steps_per_s"] / runs[0]["steps_per_s"]},
    )


if __name__ == "__main__":
    main()
