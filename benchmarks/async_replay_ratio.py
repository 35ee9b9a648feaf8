"""AsyncRl's replay-ratio throttle: achieved vs set point.

With a fast optimizer (small network, batch 256) the achieved cumulative ratio should sit
within 5% below each set point (it is a ceiling). With a slow one (512x512, batch 512, set
point 64) both sides keep running and the achieved ratio is lower (the seed's example).

    python -m benchmarks.async_replay_ratio [--quick]
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path
from typing import Any

from rlplex.agents import DqnAgent
from rlplex.algos import DQN, DQNConfig
from rlplex.envs import EnvConfig
from rlplex.runners import AsyncRl

OUT = Path("bench_results")
CARTPOLE = EnvConfig(id="CartPole-v1")


def measure(label: str, set_point: float, n_steps: int, hidden: tuple[int, ...], batch_size: int) -> dict[str, Any]:
    config = DQNConfig(batch_size=batch_size, learning_starts=0, buffer_size=100_000)
    run = AsyncRl(
        DQN(config, seed=0),
        partial(DqnAgent, hidden=hidden),
        CARTPOLE,
        batch_T=64,
        batch_B=1,  # one env per policy call: a sampler of a few thousand steps/s
        n_steps=n_steps,
        replay_ratio=set_point,
        seed=0,
        log_interval_steps=max(1, n_steps // 4),
        show_progress=False,
    )
    result = run.train()
    final = result.history[-1]
    achieved = final["charts/replay_ratio_cumulative"]
    rows = result.history
    return {
        "case": label,
        "set_point": set_point,
        "achieved": achieved,
        "relative": achieved / set_point,
        "env_steps": result.env_steps,
        "updates": final["charts/updates"],
        "env_steps_per_s": result.env_steps / result.wall_time_s,
        "updates_per_s": final["charts/updates"] / result.wall_time_s,
        "busy_fraction": sum(r["charts/optimizer_busy_fraction"] for r in rows) / len(rows),
        "wall_s": result.wall_time_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n_steps = 8192 if args.quick else 40_960
    results = [measure("fast", sp, n_steps, (32, 32), 256) for sp in (1.0, 4.0, 8.0)]
    results.append(measure("slow", 64.0, n_steps, (512, 512), 512))
    print(f"{'case':>5} {'set':>6} {'achieved':>9} {'ratio':>7} {'steps/s':>9} {'upd/s':>7} {'busy':>5}")
    for r in results:
        print(
            f"{r['case']:>5} {r['set_point']:>6g} {r['achieved']:>9.3f} {r['relative']:>7.3f} "
            f"{r['env_steps_per_s']:>9.0f} {r['updates_per_s']:>7.1f} {r['busy_fraction']:>5.2f}"
        )
    fast_ok = all(0.95 <= r["relative"] <= 1.0 + 1e-9 for r in results if r["case"] == "fast")
    print(f"\nfast optimizer within 5% below the set point: {fast_ok}")
    OUT.mkdir(exist_ok=True)
    (OUT / "async_replay_ratio.json").write_text(json.dumps({"fast_within_5pct": fast_ok, "cases": results}, indent=1))


if __name__ == "__main__":
    main()
