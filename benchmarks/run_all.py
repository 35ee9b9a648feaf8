"""Run every benchmark, one after another (they measure the machine, so never in parallel).

    python -m benchmarks.run_all [--quick] [--only NAME ...]

Each benchmark prints its own table and writes bench_results/<name>.json; this prints a
summary of which ran and how long each took.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import time

BENCHMARKS = [
    "sampler_throughput",
    "learn_ppo",
    "ppo_vs_sb3",
    "learn_dqn_cartpole",
    "classic_learning",
    "sac_update",
    "dqn_update",
    "mujoco_sac",
    "atari_smoke",
    "async_replay_ratio",
    "async_vs_minibatch",
    "sync_scaling",
    "sequence_buffer",
    "prioritized_replay",
    "executor_overhead",
    "async_dataflow",
    "grpo_learning",
    "grpo_runner_learning",
    "multirun_discovery",
    "multirun_learning",
    "multirun_throughput",
    "multirun_threading",
    "orchestrator_rollouts",
    "multilora",
    "model_loading",
    "control_plane",
    "datachannel",
    "inference_rollouts",
    "adapter_freshness",
    "real_model_learning",
    "vs_trl",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="short versions of every benchmark")
    parser.add_argument("--only", nargs="*", default=None, help="names to run (default: all)")
    args = parser.parse_args()
    names = [n for n in BENCHMARKS if args.only is None or n in args.only]
    summary = []
    for name in names:
        if importlib.util.find_spec(f"benchmarks.{name}") is None:
            continue
        command = [sys.executable, "-m", f"benchmarks.{name}", *(["--quick"] if args.quick else [])]
        print(f"\n=== {' '.join(command[1:])}", flush=True)
        t0 = time.perf_counter()
        code = subprocess.call(command)
        summary.append((name, code, time.perf_counter() - t0))
    print("\nbenchmark              exit   seconds")
    for name, code, seconds in summary:
        print(f"{name:<22} {code:>4} {seconds:>9.1f}")
    sys.exit(max((code for _, code, _ in summary), default=0))


if __name__ == "__main__":
    main()
