"""How long the multi-run bookkeeping takes: `discover_runs()` over many run directories and
`synchronize_state()` between two ranks.

    python -m benchmarks.multirun_discovery [--quick]

Goals (issue 5): a steady-state `discover_runs()` over 1,000 run directories in at most 50 ms;
`synchronize_state()` with 64 runs at world size 2 in at most 20 ms per call.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

NAME = "multirun_discovery"


def _ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered) * 1e3,
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
        "max_ms": ordered[-1] * 1e3,
    }


def _make_runs(output_dir: Path, n: int) -> None:
    from rlplex.multirun import OrchestratorConfig, create_run

    config = OrchestratorConfig(task="reverse", max_steps=100, batch_size=8)
    for i in range(n):
        create_run(output_dir, f"run_{i:05d}", config)


def bench_discovery(n_runs: int, reps: int) -> dict[str, Any]:
    from rlplex.multirun import MultiRunManager

    root = Path(tempfile.mkdtemp(prefix="mrm-bench-"))
    try:
        _make_runs(root, n_runs)
        results: dict[str, Any] = {"n_run_dirs": n_runs}
        for label, max_runs in (("all_active", n_runs), ("64_active_rest_waiting", 64)):
            mrm = MultiRunManager(root, max_runs)
            start = time.perf_counter()
            mrm.discover_runs()
            first = time.perf_counter() - start
            assert len(mrm.idx_2_id) == min(n_runs, max_runs)
            steady = []
            for _ in range(reps):
                start = time.perf_counter()
                mrm.discover_runs()
                steady.append(time.perf_counter() - start)
            results[label] = {"max_runs": max_runs, "first_scan_ms": first * 1e3, "steady": _ms(steady)}
        return results
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _sync_rank(rank: int, port: int, root: str, n_runs: int, reps: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from rlplex.multirun import setup_multi_run_manager

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    if rank == 0:
        _make_runs(Path(root), n_runs)
    dist.barrier()
    mrm = setup_multi_run_manager(root, n_runs, sync_timeout_s=60)
    mrm.register_creation_hook(lambda idx, run_id: None, name="noop_creation")
    if rank == 0:
        mrm.discover_runs()
    dist.barrier()
    start = time.perf_counter()
    mrm.synchronize_state()
    first = time.perf_counter() - start
    steady, loop = [], []
    for _ in range(reps):
        dist.barrier()  # ranks arrive together, as they do after a training step's collectives
        start = time.perf_counter()
        if rank == 0:
            mrm.discover_runs()
        mid = time.perf_counter()
        mrm.synchronize_state()
        end = time.perf_counter()
        steady.append(end - mid)
        loop.append(end - start)
    assert len(mrm.idx_2_id) == n_runs
    queue.put({"rank": rank, "first_sync_ms": first * 1e3, "steady_sync": _ms(steady), "discover_plus_sync": _ms(loop)})
    dist.destroy_process_group()


def bench_sync(n_runs: int, reps: int) -> dict[str, Any]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = tempfile.mkdtemp(prefix="mrm-sync-")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_sync_rank, args=(r, port, root, n_runs, reps, queue)) for r in range(2)]
    try:
        for proc in procs:
            proc.start()
        per_rank = sorted((queue.get(timeout=300) for _ in procs), key=lambda r: r["rank"])
        for proc in procs:
            proc.join(60)
            if proc.exitcode != 0:
                raise RuntimeError(f"sync benchmark rank exited with {proc.exitcode}")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(root, ignore_errors=True)
    return {"n_runs": n_runs, "world_size": 2, "ranks": per_rank}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer directories and repetitions")
    args = parser.parse_args()
    n_dirs, n_sync, reps = (200, 64, 5) if args.quick else (1000, 64, 30)

    discovery = bench_discovery(n_dirs, reps)
    sync = bench_sync(n_sync, reps)

    table = Table(title=f"multi-run bookkeeping ({os.cpu_count()} CPUs)")
    for column in ("measure", "median ms", "p90 ms", "goal ms"):
        table.add_column(column, justify="right")
    for label in ("all_active", "64_active_rest_waiting"):
        part = discovery[label]
        table.add_row(
            f"first discover_runs, {n_dirs} dirs, max_runs={part['max_runs']}", f"{part['first_scan_ms']:.1f}", "", ""
        )
        steady = part["steady"]
        table.add_row(
            f"steady discover_runs, {n_dirs} dirs, max_runs={part['max_runs']}",
            f"{steady['median_ms']:.2f}",
            f"{steady['p90_ms']:.2f}",
            "50",
        )
    for rank in sync["ranks"]:
        table.add_row(
            f"first synchronize_state, {n_sync} new runs, rank {rank['rank']}", f"{rank['first_sync_ms']:.1f}", "", ""
        )
        table.add_row(
            f"steady synchronize_state, {n_sync} runs, rank {rank['rank']}",
            f"{rank['steady_sync']['median_ms']:.2f}",
            f"{rank['steady_sync']['p90_ms']:.2f}",
            "20",
        )
    Console().print(table)
    results = Path("bench_results")
    results.mkdir(exist_ok=True)
    path = results / f"{NAME}.json"
    machine = {"cpus": os.cpu_count(), "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    path.write_text(
        json.dumps(
            {"benchmark": NAME, "machine": machine, "quick": args.quick, "discovery": discovery, "sync": sync}, indent=2
        )
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
