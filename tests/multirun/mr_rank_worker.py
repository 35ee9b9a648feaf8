"""One trainer rank for the multi-process tests: `python mr_rank_worker.py SCENARIO RANK WORLD PORT DIR`.

Writes what it observed to DIR/result_<rank>.json; exits non-zero on an unexpected error.
"""

from __future__ import annotations

import json
import shutil
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

torch.set_num_threads(1)
# Run as a script: tests/multirun is on sys.path, tests/ (lm_models) is not.
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

from mr_helpers import new_run  # noqa: E402

from rlplex.errors import HookMismatchError  # noqa: E402
from rlplex.multirun import RunDir, setup_multi_run_manager  # noqa: E402
from rlplex.multirun.rundir import write_finished  # noqa: E402


def scenario_sync(rank: int, out: Path) -> dict[str, Any]:
    runs_dir = out / "runs"
    if rank == 0:
        runs_dir.mkdir()
        new_run(runs_dir, "run_a", model={"lora": {"rank": 4, "alpha": 8.0}})
        new_run(runs_dir, "run_b")
    dist.barrier()  # rank 0 made the directories (the test's setup, not the manager's protocol)
    mrm = setup_multi_run_manager(runs_dir, 3, sync_timeout_s=20)
    calls: list[str] = []
    barrier_results: list[float] = []

    def create_optimizer(idx: int, run_id: str) -> None:
        calls.append(f"create_optimizer {idx} {run_id}")

    def collective_setup(idx: int, run_id: str) -> None:
        dist.barrier()
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value)  # a collective inside a creation hook must line up on every rank
        barrier_results.append(value.item())
        calls.append(f"collective_setup {idx} {run_id}")

    def drop_optimizer(idx: int, run_id: str) -> None:
        calls.append(f"drop_optimizer {idx} {run_id}")

    def drop_buffers(idx: int, run_id: str) -> None:
        dist.barrier()
        calls.append(f"drop_buffers {idx} {run_id}")

    mrm.register_creation_hook(create_optimizer)
    mrm.register_deletion_hook(drop_optimizer)
    mrm.register_creation_hook(collective_setup)
    mrm.register_deletion_hook(drop_buffers)
    tables = []
    for step in range(4):
        if rank == 0:
            if step == 2:
                shutil.rmtree(runs_dir / "run_a")
                new_run(runs_dir, "run_c")
            mrm.discover_runs()
            mrm.record_progress(mrm.id_2_idx["run_b"], tokens=7, samples=1)
        mrm.synchronize_state()
        tables.append(
            {
                "idx_2_id": {str(k): v for k, v in sorted(mrm.idx_2_id.items())},
                "scaling": mrm.scaling_factors.tolist(),
                "ranks": mrm.lora_ranks.tolist(),
                "b_tokens": mrm.progress[mrm.id_2_idx["run_b"]].total_tokens,
            }
        )
    return {"calls": calls, "tables": tables, "barrier_results": barrier_results}


def scenario_mismatch(rank: int, out: Path) -> dict[str, Any]:
    runs_dir = out / "runs_mismatch"
    if rank == 0:
        runs_dir.mkdir()
        new_run(runs_dir, "run_a")
    dist.barrier()
    # A second setup in the same processes: its store keys must not meet the first manager's.
    mrm = setup_multi_run_manager(runs_dir, 2, sync_timeout_s=20)
    if rank == 0:

        def rank0_only_hook(idx: int, run_id: str) -> None:
            dist.barrier()  # would deadlock if rank 1 did not raise first

        mrm.register_creation_hook(rank0_only_hook)
        mrm.discover_runs()
    try:
        mrm.synchronize_state()
    except HookMismatchError as error:
        return {"error": str(error)}
    return {"error": None}


def scenario_finish(rank: int, out: Path) -> dict[str, Any]:
    """One slot, two runs: run_a finishes (rank 0 writes its marker, as the trainer does) and
    run_b, waiting, takes the slot on every rank."""
    runs_dir = out / "runs_finish"
    if rank == 0:
        runs_dir.mkdir()
        new_run(runs_dir, "run_a")
        new_run(runs_dir, "run_b")
    dist.barrier()
    mrm = setup_multi_run_manager(runs_dir, 1, sync_timeout_s=20)
    calls: list[str] = []
    mrm.register_deletion_hook(lambda idx, run_id: calls.append(f"deletion {idx} {run_id}"))
    mrm.register_creation_hook(lambda idx, run_id: calls.append(f"creation {idx} {run_id}"))
    tables = []
    for step in range(3):
        if rank == 0:
            if step == 1:
                write_finished(RunDir(runs_dir, "run_a"), 10)
            mrm.discover_runs()
        mrm.synchronize_state()
        tables.append({str(k): v for k, v in sorted(mrm.idx_2_id.items())})
    return {"calls": calls, "tables": tables, "statuses": mrm.run_statuses()}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[5])
    rank, world, port = (int(arg) for arg in sys.argv[2:5])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        # One process start-up serves every scenario: starting torch twice per rank is the slow part.
        scenarios = {"sync": scenario_sync, "mismatch": scenario_mismatch, "finish": scenario_finish}
        names = list(scenarios) if scenario == "all" else [scenario]
        result = {name: scenarios[name](rank, out) for name in names}
    except BaseException:
        (out / f"error_{rank}.txt").write_text(traceback.format_exc())
        raise
    (out / f"result_{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
