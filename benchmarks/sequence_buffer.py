"""SequenceBuffer throughput and latency: puts/s, key-amends/s, get_batch_for_rpc p50/p99.

    python -m benchmarks.sequence_buffer [--quick]

Four MFCs (gen -> ref, rew -> train) as in the PPO graph; latency is measured for a
consumer taking a batch of 16 while the buffer holds 1k and 100k datapoints.
Goals (issue 4): >= 200k key-amends/s; p99 <= 1 ms at 100k occupancy.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

from benchmarks.common import report
from rlplex.dataflow import MFCDef, ModelInterfaceType, SequenceBuffer

GEN = MFCDef("gen", "actor", ModelInterfaceType.GENERATE, ("prompt",), ("ids", "logp"), 16)
REF = MFCDef("ref", "ref", ModelInterfaceType.INFERENCE, ("ids",), ("ref_logp",), 16)
REW = MFCDef("rew", "reward", ModelInterfaceType.INFERENCE, ("ids",), ("reward",), 16)
TRAIN = MFCDef("train", "actor", ModelInterfaceType.TRAIN_STEP, ("ids", "logp", "ref_logp", "reward"), (), 16)
KEYS = ("prompt", "ids", "logp", "ref_logp", "reward")


async def measure(n: int, occupancy: int, chunk: int = 256) -> dict[str, float]:
    buf = SequenceBuffer([GEN, REF, REW, TRAIN], KEYS, capacity=max(n, occupancy) + 64)
    t0 = time.perf_counter()
    ids: list[int] = []
    for start in range(0, n, chunk):
        ids.extend(await buf.put_batch(["prompt"], [8] * min(chunk, n - start)))
    put_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    amends = 0
    for key_set in (["ids", "logp"], ["ref_logp"], ["reward"]):
        for start in range(0, n, chunk):
            buf.amend_batch(ids[start : start + chunk], key_set)
            amends += len(ids[start : start + chunk]) * len(key_set)
    amend_s = time.perf_counter() - t0

    # Latency of one training batch of 16 at the requested occupancy (fully ready datapoints).
    latencies = []
    for _ in range(min(2000, occupancy // 16)):
        t = time.perf_counter()
        batch = await buf.get_batch_for_rpc(TRAIN)
        latencies.append(time.perf_counter() - t)
        del batch
    lat = np.array(latencies) * 1e3
    return {
        "datapoints": n,
        "occupancy": occupancy,
        "puts_per_s": n / put_s,
        "key_amends_per_s": amends / amend_s,
        "get_p50_ms": float(np.percentile(lat, 50)),
        "get_p99_ms": float(np.percentile(lat, 99)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    big = 20_000 if args.quick else 100_000
    results = [asyncio.run(measure(1_000, 1_000)), asyncio.run(measure(big, big))]
    rows = [(r["occupancy"], r["puts_per_s"], r["key_amends_per_s"], r["get_p50_ms"], r["get_p99_ms"]) for r in results]
    at_big = results[-1]
    figures = {
        "results": results,
        "goal_key_amends_per_s": 200_000,
        "goal_p99_ms_at_100k": 1.0,
        "meets_amend_goal": at_big["key_amends_per_s"] >= 200_000,
        "meets_latency_goal": at_big["get_p99_ms"] <= 1.0,
    }
    columns = ("occupancy", "puts/s", "key-amends/s", "get p50 ms", "get p99 ms")
    report("sequence_buffer", "SequenceBuffer (4 MFCs, batch 16)", columns, rows, figures)


if __name__ == "__main__":
    main()
