"""DataChannel throughput: one producer process, one consumer process, 1 KB and 1 MB numpy items.

Compares LocalDataChannel with multiprocessing.Queue, and RayDataChannel with
ray.util.queue.Queue, in the same run, all with capacity 16. The consumer times from the
first item after a warm-up to the last one and touches each item (reads its first and
last byte). Goal: LocalDataChannel >= 2x multiprocessing.Queue for 1 MB items.

    python -m benchmarks.datachannel [--quick]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from rlplex.control import LocalDataChannel, RayDataChannel

CAPACITY = 16
WARMUP = 20
SIZES = {"1KB": 1 << 10, "1MB": 1 << 20}
RESULTS = Path("bench_results")
SRC = str(Path(__file__).resolve().parents[1] / "src")


def produce(queue: Any, nbytes: int, count: int) -> None:
    item = np.random.default_rng(0).integers(0, 255, size=nbytes, dtype=np.uint8)
    for _ in range(count):
        queue.put(item)
    queue.put(None)


def consume(queue: Any, result: Any = None) -> tuple[int, float]:
    seen, started = 0, 0.0
    while True:
        item = queue.get()
        if item is None:
            break
        _ = int(item[0]) + int(item[-1])
        seen += 1
        if seen == WARMUP:
            started = time.perf_counter()
    measured = (seen - WARMUP, time.perf_counter() - started)
    if result is not None:
        result.put(measured)
    return measured


def run_processes(queue: Any, nbytes: int, count: int) -> tuple[int, float]:
    context = mp.get_context("spawn")
    result = context.Queue()
    procs = [
        context.Process(target=consume, args=(queue, result), daemon=True),
        context.Process(target=produce, args=(queue, nbytes, count), daemon=True),
    ]
    for proc in procs:
        proc.start()
    try:
        measured: tuple[int, float] = result.get(timeout=300)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return measured


def run_ray(queue: Any, nbytes: int, count: int) -> tuple[int, float]:
    import ray

    producer = ray.remote(num_cpus=0)(produce).remote(queue, nbytes, count)
    measured: tuple[int, float] = ray.get(ray.remote(num_cpus=0)(consume).remote(queue), timeout=600)
    ray.get(producer, timeout=60)
    return measured


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer items (a smoke run)")
    args = parser.parse_args(argv)
    scale = 0.1 if args.quick else 1.0
    counts = {  # items per run, sized to take a few seconds each on a small machine
        ("local", "1KB"): 20000,
        ("mp.Queue", "1KB"): 20000,
        ("local", "1MB"): 2000,
        ("mp.Queue", "1MB"): 500,
        ("ray", "1KB"): 2000,
        ("ray.util.queue", "1KB"): 2000,
        ("ray", "1MB"): 500,
        ("ray.util.queue", "1MB"): 500,
    }
    rows: list[dict[str, Any]] = []

    def record(impl: str, size: str, measured: tuple[int, float]) -> None:
        items, seconds = measured
        rate = items / seconds
        mb_s = rate * SIZES[size] / 1e6
        rows.append({"impl": impl, "item": size, "items": items, "seconds": seconds, "items_s": rate, "mb_s": mb_s})
        print(f"{impl:>15} {size:>4}: {rate:12,.0f} items/s {rate * SIZES[size] / 1e6:10,.1f} MB/s", flush=True)

    def n(impl: str, size: str) -> int:
        return max(WARMUP + 10, int(counts[(impl, size)] * scale))

    for size, nbytes in SIZES.items():
        name = f"bench-{uuid.uuid4().hex[:8]}"
        channel = LocalDataChannel.create(name, capacity=CAPACITY, slot_bytes=nbytes + 4096)
        try:
            record("local", size, run_processes(channel, nbytes, n("local", size)))
        finally:
            channel.unlink()
            channel.detach()
        record("mp.Queue", size, run_processes(mp.get_context("spawn").Queue(CAPACITY), nbytes, n("mp.Queue", size)))

    import ray
    from ray.util.queue import Queue as RayQueue

    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": SRC}})
    try:
        for size, nbytes in SIZES.items():
            ray_channel = RayDataChannel.create(f"bench-{uuid.uuid4().hex[:8]}", capacity=CAPACITY)
            record("ray", size, run_ray(ray_channel, nbytes, n("ray", size)))
            ray_channel.destroy()
            baseline = RayQueue(maxsize=CAPACITY, actor_options={"num_cpus": 0})
            record("ray.util.queue", size, run_ray(baseline, nbytes, n("ray.util.queue", size)))
            baseline.shutdown()
    finally:
        ray.shutdown()

    def rate(impl: str, size: str) -> float:
        return next(r["items_s"] for r in rows if r["impl"] == impl and r["item"] == size)

    speedups = {f"local_vs_mp_queue_{size}": rate("local", size) / rate("mp.Queue", size) for size in SIZES} | {
        f"ray_vs_ray_util_queue_{size}": rate("ray", size) / rate("ray.util.queue", size) for size in SIZES
    }
    print()
    print(f"{'impl':>15} {'item':>5} {'items':>7} {'items/s':>12} {'MB/s':>10}")
    for row in rows:
        print(f"{row['impl']:>15} {row['item']:>5} {row['items']:>7} {row['items_s']:>12,.0f} {row['mb_s']:>10,.1f}")
    for key, value in speedups.items():
        print(f"{key}: {value:.2f}x")
    goal = speedups["local_vs_mp_queue_1MB"] >= 2.0
    print(f"goal LocalDataChannel >= 2x multiprocessing.Queue at 1 MB: {'met' if goal else 'NOT met'}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "datachannel.json"
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    payload = {"benchmark": "datachannel", "machine": machine, "quick": args.quick, "capacity": CAPACITY}
    path.write_text(json.dumps(payload | {"rows": rows, "speedups": speedups, "goal_met": goal}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
