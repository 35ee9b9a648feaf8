"""synchronize_state() across a real gloo group of world size 2 (two spawned processes)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_world(
    scenario: str, out: Path, world: int = 2, timeout_s: float = 90.0, worker: str = "mr_rank_worker.py"
) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{HERE}", "OMP_NUM_THREADS": "1"}
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / worker), scenario, str(rank), str(world), str(port), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(world)
    ]
    try:
        logs = [proc.communicate(timeout=timeout_s)[0].decode(errors="replace") for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{logs[rank][-3000:]}"
    return [json.loads((out / f"result_{rank}.json").read_text()) for rank in range(world)]


@pytest.fixture(scope="module")
def world_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_world("all", tmp_path_factory.mktemp("world"))


def test_state_sync_hook_order_and_collectives_inside_hooks(world_results: list[dict[str, Any]]) -> None:
    results = [r["sync"] for r in world_results]
    expected_calls = [
        "create_optimizer 0 run_a",
        "collective_setup 0 run_a",
        "create_optimizer 1 run_b",
        "collective_setup 1 run_b",
        # step 2: run_a deleted, run_c takes its slot: deletion hooks first, in registration order
        "drop_optimizer 0 run_a",
        "drop_buffers 0 run_a",
        "create_optimizer 0 run_c",
        "collective_setup 0 run_c",
    ]
    for rank, result in enumerate(results):
        assert result["calls"] == expected_calls, rank
        assert result["barrier_results"] == [3.0, 3.0, 3.0], rank  # all_reduce of 1 + 2 in each creation
    assert results[0]["tables"] == results[1]["tables"]
    final = results[1]["tables"][-1]
    assert final["idx_2_id"] == {"0": "run_c", "1": "run_b"}
    assert final["scaling"] == [2.0, 2.0, 1e6] and final["ranks"] == [8, 8, 0]
    assert [t["b_tokens"] for t in results[1]["tables"]] == [7, 14, 21, 28]
    assert results[1]["tables"][0]["scaling"] == [2.0, 2.0, 1e6] and results[1]["tables"][0]["ranks"] == [4, 8, 0]


def test_mismatched_hook_registration_is_a_clear_error_on_every_rank(world_results: list[dict[str, Any]]) -> None:
    results = [r["mismatch"] for r in world_results]
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} did not detect the mismatch"
        assert "rank0_only_hook" in result["error"] and "hook registration differs" in result["error"]


def test_finished_run_leaves_its_slot_on_every_rank(world_results: list[dict[str, Any]]) -> None:
    results = [r["finish"] for r in world_results]
    for rank, result in enumerate(results):
        assert result["calls"] == ["creation 0 run_a", "deletion 0 run_a", "creation 0 run_b"], rank
        assert result["tables"] == [{"0": "run_a"}, {"0": "run_b"}, {"0": "run_b"}], rank
    assert results[0]["statuses"] == {"run_a": "finished", "run_b": "active"}
    assert results[1]["statuses"] == {"run_b": "active"}  # other ranks know the active runs only
