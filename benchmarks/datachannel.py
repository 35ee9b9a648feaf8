"""DataChannel throughput: one producer process, one consumer process, 1 KB, 64 KB and 1 MB numpy items.

Compares LocalDataChannel with multiprocessing.Queue, and RayDataChannel with
ray.util.queue.Queue (1 KB and 1 MB), in the same run, all with capacity 16. The consumer
times from the first item after a warm-up to the last one and touches each item (reads its
first and last byte). Local and mp.Queue runs alternate, `--repeats` times per size, and the
median rate of each is compared, so both see the same machine load.
Goals: LocalDataChannel >= 1x multiprocessing.Queue at 1 KB (issue 14) and >= 2x at 1 MB.

    python -m benchmarks.datachannel [--quick] [--repeats N] [--no-ray]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from rlplex.control import LocalDataChannel, RayDataChannel

CAPACITY = 16
WARMUP = 20
SIZES = {"1KB": 1 << 10, "64KB": 64 << 10, "1MB": 1 << 20}
RAY_SIZES = ("1KB", "1MB")
GOALS = {"1KB": 1.0, "1MB": 2.0}  # LocalDataChannel / multiprocessing.Queue, items/s
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


def run_local(nbytes: int, count: int) -> tuple[int, float]:
    channel = LocalDataChannel.create(f"bench-{uuid.uuid4().hex[:8]}", capacity=CAPACITY, slot_bytes=nbytes + 4096)
    try:
        return run_processes(channel, nbytes, count)
    finally:
        channel.unlink()
        channel.detach()


def run_mp_queue(nbytes: int, count: int) -> tuple[int, float]:
    return run_processes(mp.get_context("spawn").Queue(CAPACITY), nbytes, count)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer items (a smoke run)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating local / mp.Queue runs per size")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray comparisons")
    args = parser.parse_args(argv)
    scale = 0.1 if args.quick else 1.0
    repeats = 1 if args.quick else max(1, args.repeats)
    counts = {  # items per run, sized to take about a second each on a small machine
        ("local", "1KB"): 40000,
        ("mp.Queue", "1KB"): 20000,
        ("local", "64KB"): 10000,
        ("mp.Queue", "64KB"): 5000,
        ("local", "1MB"): 2000,
        ("mp.Queue", "1MB"): 500,
        ("ray", "1KB"): 2000,
        ("ray.util.queue", "1KB"): 2000,
        ("ray", "1MB"): 500,
        ("ray.util.queue", "1MB"): 500,
    }
    rows: list[dict[str, Any]] = []

    def n(impl: str, size: str) -> int:
        return max(WARMUP + 10, int(counts[(impl, size)] * scale))

    def record(impl: str, size: str, runs: list[tuple[int, float]]) -> None:
        rates = [items / seconds for items, seconds in runs]
        rate = statistics.median(rates)
        mb_s = rate * SIZES[size] / 1e6
        items = sum(items for items, _ in runs)
        seconds = sum(seconds for _, seconds in runs)
        rows.append(
            {"impl": impl, "item": size, "items": items, "seconds": seconds, "items_s": rate, "mb_s": mb_s}
            | {"runs_items_s": rates}
        )
        spread = f"(runs: {', '.join(f'{r:,.0f}' for r in rates)})" if len(rates) > 1 else ""
        print(f"{impl:>15} {size:>4}: {rate:12,.0f} items/s {mb_s:10,.1f} MB/s {spread}", flush=True)

    for size, nbytes in SIZES.items():
        local_runs, queue_runs = [], []
        for _ in range(repeats):  # alternated, so a burst of load on the machine hits both
            local_runs.append(run_local(nbytes, n("local", size)))
            queue_runs.append(run_mp_queue(nbytes, n("mp.Queue", size)))
        record("local", size, local_runs)
        record("mp.Queue", size, queue_runs)

    if not args.no_ray:
        import ray
        from ray.util.queue import Queue as RayQueue

        from rlplex.control.backends.ray import LOCAL_RAY_SYSTEM_CONFIG

        ray.init(
            num_cpus=2,
            include_dashboard=False,
            runtime_env={"env_vars": {"PYTHONPATH": SRC}},
            _system_config=LOCAL_RAY_SYSTEM_CONFIG,
        )
        try:
            for size in RAY_SIZES:
                nbytes = SIZES[size]
                ray_channel = RayDataChannel.create(f"bench-{uuid.uuid4().hex[:8]}", capacity=CAPACITY)
                record("ray", size, [run_ray(ray_channel, nbytes, n("ray", size))])
                ray_channel.destroy()
                baseline = RayQueue(maxsize=CAPACITY, actor_options={"num_cpus": 0})
                record("ray.util.queue", size, [run_ray(baseline, nbytes, n("ray.util.queue", size))])
                baseline.shutdown()
        finally:
            ray.shutdown()

    def rate(impl: str, size: str) -> float:
        return next(r["items_s"] for r in rows if r["impl"] == impl and r["item"] == size)

    speedups = {f"local_vs_mp_queue_{size}": rate("local", size) / rate("mp.Queue", size) for size in SIZES}
    if not args.no_ray:
        speedups |= {
            f"ray_vs_ray_util_queue_{size}": rate("ray", size) / rate("ray.util.queue", size) for size in RAY_SIZES
        }
    print()
    print(f"{'item':>5} {'local items/s':>14} {'mp.Queue items/s':>17} {'ratio':>7}")
    for size in SIZES:
        local, queue = rate("local", size), rate("mp.Queue", size)
        print(f"{size:>5} {local:>14,.0f} {queue:>17,.0f} {local / queue:>6.2f}x")
    print()
    print(f"{'impl':>15} {'item':>5} {'items':>7} {'items/s':>12} {'MB/s':>10}")
    for row in rows:
        print(f"{row['impl']:>15} {row['item']:>5} {row['items']:>7} {row['items_s']:>12,.0f} {row['mb_s']:>10,.1f}")
    for key, value in speedups.items():
        print(f"{key}: {value:.2f}x")
    goals = {}
    for size, factor in GOALS.items():
        goals[f"local_ge_{factor:g}x_mp_queue_{size}"] = met = speedups[f"local_vs_mp_queue_{size}"] >= factor
        print(f"goal LocalDataChannel >= {factor:g}x multiprocessing.Queue at {size}: {'met' if met else 'NOT met'}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "datachannel.json"
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    payload = {"benchmark": "datachannel", "machine": machine, "quick": args.quick, "capacity": CAPACITY}
    payload |= {"repeats": repeats, "ray": not args.no_ray}
    path.write_text(
        json.dumps(
            payload | {"rows": rows, "speedups": speedups, "goals": goals, "goal_met": all(goals.values())}, indent=2
        )
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
