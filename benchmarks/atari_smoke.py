"""A CNN DQN and a CNN PPO train on Atari Pong for 50k frames (12.5k agent steps, frame skip 4)
from examples/pong_{dqn,ppo}.toml, then resume from their last snapshot for one more log
interval. Checks that every logged loss is finite and that the resumed run continues the
step counter; reports wall time and frames/s (sampling and updates together).

    python -m benchmarks.atari_smoke [--quick] [--frames N]

Changed from the example files, to fit 50k frames: DQN's learning starts 2,500 (not 100k)
and logs every 2,500 steps; PPO's sampler is serial (on two busy cores two workers only add
start-up); both evaluate 2 whole games (unclipped scores) at each log row. This is a smoke
test (no learning is expected in 50k frames; Pong needs millions). Writes
bench_results/atari_smoke.json.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import override, report
from rlplex.io.snapshot import latest_snapshot
from rlplex.runners.config import build_runner, load_train_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LOSSES = ("losses/td", "losses/q_mean", "losses/policy", "losses/value", "losses/entropy")


def settings(algo: str, n_steps: int) -> Any:
    config = load_train_config(EXAMPLES / f"pong_{algo}.toml")
    log = max(1, n_steps // 2)  # each DQN snapshot holds the replay (14 KB a transition: two frames)
    if algo == "dqn":
        config = override(config, "algo", learning_starts=min(2_500, n_steps // 2))
    else:
        config = override(config, "sampler", kind="serial")
        log = max(n_steps // 5, 1024)
    return override(config, "runner", n_steps=n_steps, log_interval_steps=log, eval_episodes=2, snapshot_mode="last")


def run(algo: str, n_steps: int, out: Path) -> dict[str, Any]:
    config = settings(algo, n_steps)
    t0 = time.perf_counter()
    first = build_runner(config, out, show_progress=False).train()
    wall = time.perf_counter() - t0
    extra = config.runner.log_interval_steps
    longer = override(config, "runner", n_steps=first.env_steps + extra)
    resumed_runner = build_runner(longer, out, show_progress=False)
    resumed_runner.resume_from(latest_snapshot(out / "snapshots"))
    resumed = resumed_runner.train()
    losses = [row[key] for row in first.history + resumed.history for key in LOSSES if key in row]
    return {
        "algo": algo,
        "env_steps": first.env_steps,
        "frames": first.env_steps * 4,
        "wall_s": wall,
        "frames_per_s": first.env_steps * 4 / wall,
        "losses_logged": len(losses),
        "losses_finite": bool(losses) and all(math.isfinite(v) for v in losses),
        "final_eval_return": first.history[-1].get("charts/eval_return_mean"),
        "resumed_from_steps": first.env_steps,
        "resumed_to_steps": resumed.env_steps,
        # Batches round the budget up to whole iterations, so the target is "at least".
        "resume_continued": resumed.env_steps >= first.env_steps + extra
        and resumed.history[0]["charts/env_steps"] > first.env_steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10k frames instead of 50k")
    parser.add_argument("--frames", type=int, default=None, help="frames per algorithm (agent steps x 4)")
    args = parser.parse_args()
    frames = args.frames or (10_000 if args.quick else 50_000)
    results = []
    for algo in ("dqn", "ppo"):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(run(algo, frames // 4, Path(tmp) / algo))
        print(results[-1], flush=True)
    rows = [
        (r["algo"], r["frames"], r["wall_s"], r["frames_per_s"], r["losses_finite"], r["final_eval_return"],
         f"{r['resumed_from_steps']} -> {r['resumed_to_steps']}", r["resume_continued"])
        for r in results
    ]  # fmt: skip
    columns = ("algo", "frames", "wall s", "frames/s", "losses finite", "eval return", "resume steps", "resumed")
    report("atari_smoke", f"Pong, Nature CNN, {frames:,} frames each", columns, rows, {"results": results})
    if not all(r["losses_finite"] and r["resume_continued"] for r in results):
        raise SystemExit("atari_smoke: a loss was not finite or the resume did not continue")


if __name__ == "__main__":
    main()
