"""SequenceBuffer on AReaL's buffer workload, and DataPlane.release at 100k datapoints.

    python -m benchmarks.sequence_buffer [--quick]

AReaL's workload (its buffer benchmark): the PPO graph's four MFCs, actor_gen -> ref_inf,
rew_inf -> actor_train, each taking n_seqs = 256. N = 100,096 datapoints are put in chunks
of 256, so the buffer starts full; then each step, in topological order, every MFC gets a
batch of 256, amends its output key on all 256 ids (actor_train has none) and finishes them,
which frees each datapoint after actor_train. Only the buffer calls are timed, each alone.
A key amend is one key added to one datapoint.

Goals (issue 17): >= 3x AReaL's 64k key amends/s (192k) and get p99 <= 1 ms.
Also timed: `DataPlane.release` of 256 ids with 100k datapoints (4 keys each) in flight,
which scanned every value in flight before issue 17.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

from benchmarks.common import report
from rlplex.dataflow import DataPlane, LocalTensorStore, MFCDef, ModelInterfaceType, SequenceBuffer

N_SEQS = 256
GEN = MFCDef("actor_gen", "actor", ModelInterfaceType.GENERATE, ("prompt",), ("seq",), N_SEQS)
REF = MFCDef("ref_inf", "ref", ModelInterfaceType.INFERENCE, ("seq",), ("ref_logp",), N_SEQS)
REW = MFCDef("rew_inf", "reward", ModelInterfaceType.INFERENCE, ("seq",), ("reward",), N_SEQS)
TRAIN = MFCDef("actor_train", "actor", ModelInterfaceType.TRAIN_STEP, ("seq", "ref_logp", "reward"), (), N_SEQS)
MFCS = (GEN, REF, REW, TRAIN)  # topological order
KEYS = ("prompt", "seq", "ref_logp", "reward")
GOAL_AMENDS_PER_S = 3 * 64_000


async def areal_workload(n: int) -> dict[str, float]:
    buf = SequenceBuffer(MFCS, KEYS, capacity=n)
    put_s = 0.0
    for _ in range(n // N_SEQS):
        t = time.perf_counter()
        await buf.put_batch(["prompt"], [128] * N_SEQS)
        put_s += time.perf_counter() - t
    get_lat: list[float] = []
    amend_s = finish_s = 0.0
    amends = freed = 0
    for _ in range(n // N_SEQS):
        for mfc in MFCS:
            t = time.perf_counter()
            batch = await buf.get_batch_for_rpc(mfc)
            get_lat.append(time.perf_counter() - t)
            if mfc.output_keys:
                t = time.perf_counter()
                buf.amend_batch(batch.ids, mfc.output_keys)
                amend_s += time.perf_counter() - t
                amends += len(batch.ids) * len(mfc.output_keys)
            t = time.perf_counter()
            freed += len(buf.finish(mfc, batch.ids))
            finish_s += time.perf_counter() - t
    if freed != n or buf.size:
        raise RuntimeError(f"the workload freed {freed} of {n} datapoints ({buf.size} left)")
    lat_ms = np.array(get_lat) * 1e3
    total_s = put_s + sum(get_lat) + amend_s + finish_s
    return {
        "datapoints": n,
        "key_amends_per_s": amends / amend_s,
        "datapoints_per_s": n / total_s,
        "get_p50_ms": float(np.percentile(lat_ms, 50)),
        "get_p99_ms": float(np.percentile(lat_ms, 99)),
        "get_max_ms": float(lat_ms.max()),
        "buffer_s": total_s,
    }


def release_ms(n: int, batches: int = 50) -> dict[str, float]:
    """ms per `DataPlane.release` of 256 ids with `n` datapoints (4 keys each) in flight."""
    stores = [LocalTensorStore(f"worker{i}") for i in range(4)]
    plane = DataPlane(stores)
    for start in range(0, n, N_SEQS):
        ids = list(range(start, min(start + N_SEQS, n)))
        for key, store in zip(KEYS, stores, strict=True):
            store.put_many(ids, key, [0] * len(ids))
            plane.record(store.name, ids, [key])
    times = []
    for b in range(batches):
        ids = list(range(b * N_SEQS, (b + 1) * N_SEQS))
        t = time.perf_counter()
        plane.release(ids)
        times.append(time.perf_counter() - t)
    ms = np.array(times) * 1e3
    return {"release_in_flight": n, "release_p50_ms": float(np.percentile(ms, 50)), "release_max_ms": float(ms.max())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n = 20_224 if args.quick else 100_096  # multiples of 256
    result = asyncio.run(areal_workload(n))
    release = release_ms(n)
    figures = {
        "results": [result],
        "release": release,
        "goal_key_amends_per_s": GOAL_AMENDS_PER_S,
        "goal_get_p99_ms": 1.0,
        "meets_amend_goal": result["key_amends_per_s"] >= GOAL_AMENDS_PER_S,
        "meets_latency_goal": result["get_p99_ms"] <= 1.0,
    }
    rows = [
        (
            result["datapoints"],
            result["key_amends_per_s"],
            result["datapoints_per_s"],
            result["get_p50_ms"],
            result["get_p99_ms"],
            release["release_p50_ms"],
        )
    ]
    columns = ("datapoints", "key amends/s", "datapoints/s", "get p50 ms", "get p99 ms", "release(256) ms")
    report("sequence_buffer", "SequenceBuffer, AReaL's workload (4 MFCs, n_seqs 256)", columns, rows, figures)


if __name__ == "__main__":
    main()
