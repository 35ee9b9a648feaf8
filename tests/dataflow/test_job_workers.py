"""Model workers as roles of a control-plane job: placed, restarted and reissued by the control plane."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from node_helpers import node_processes, wait_for
from rlplex.control import JobBuilder, JobState, PrimeMaster
from timing import scaled

pytestmark = pytest.mark.e2e

NODE = "rlplex.dataflow.job_worker:ModelWorkerNode"


@pytest.fixture
def job_dir(tmp_path: Path) -> Iterator[Path]:
    out = tmp_path / "job"
    try:
        yield out
    finally:
        _gone, alive = psutil.wait_procs(node_processes(out), timeout=5.0)
        for process in alive:
            process.kill()
        assert not alive, f"orphan node processes left behind: {[p.pid for p in alive]}"


# The roles' default deadline, stretched on a busy machine: a node's silence is not what these
# tests provoke (a killed node is seen by its exit), so a late heartbeat must not restart one.
HEARTBEAT_S = scaled(3.0)


def build_job(
    job_dir: Path, steps: int, generator_kwargs: dict[str, str], reward_kwargs: dict[str, str] | None = None
) -> PrimeMaster:
    trained = str(job_dir.parent / "trained.txt")
    spec = (
        JobBuilder("dataflow", job_dir, capacity={"cpu": 4})
        .role("generator", entrypoint=NODE, count=2, resources={"cpu": 0.5}, heartbeat_timeout_s=HEARTBEAT_S,
              config={"interface": "process_interfaces:Generator", "kwargs": generator_kwargs},
              restart={"scope": "worker", "max_restarts": 2})
        .role("reward", entrypoint=NODE, resources={"cpu": 0.5}, heartbeat_timeout_s=HEARTBEAT_S,
              config={"interface": "process_interfaces:Reward", "kwargs": reward_kwargs or {}})
        .role("trainer", entrypoint=NODE, resources={"cpu": 0.5}, heartbeat_timeout_s=HEARTBEAT_S,
              config={"interface": "process_interfaces:Trainer", "kwargs": {"log": trained}})
        .role("master", kind="driver", entrypoint="job_driver:drive", resources={"cpu": 0.5},
              heartbeat_timeout_s=HEARTBEAT_S, config={"steps": steps})
        .build()
    )  # fmt: skip
    return PrimeMaster.create(spec)


def trained(job_dir: Path) -> list[int]:
    return sorted(int(line) for line in (job_dir.parent / "trained.txt").read_text().split())


def test_dataflow_steps_run_on_control_plane_nodes(job_dir: Path) -> None:
    with build_job(job_dir, steps=2, generator_kwargs={}) as master:
        master.start()
        assert master.wait(timeout=scaled(120)) == JobState.STOPPED
        pids = {n.node_id: n.pid for ns in master.get_nodes_by_role().values() for n in ns}
    assert trained(job_dir) == list(range(16))
    assert (job_dir / "driver_restarts.txt").read_text() == "0"
    assert len(set(pids.values())) == 5 and os.getpid() not in pids.values()


def test_killed_generation_node_is_restarted_by_the_control_plane_and_its_call_reissued(job_dir: Path) -> None:
    marker = job_dir.parent / "blocked_pid"
    with build_job(job_dir, steps=1, generator_kwargs={"block_first_call_in": str(marker)}) as master:
        master.start()
        wait_for(lambda: marker.exists() and marker.read_text(), 60, "a generator to block in its first call")
        victim = int(marker.read_text())
        os.kill(victim, signal.SIGKILL)
        assert master.wait(timeout=scaled(120)) == JobState.STOPPED
        generators = master.get_nodes_by_role()["generator"]
    assert sorted(n.restarts for n in generators) == [0, 1]
    assert victim not in [n.pid for n in generators]
    assert (job_dir / "driver_restarts.txt").read_text() == "1"
    assert trained(job_dir) == list(range(8))  # nothing lost, nothing trained twice


def test_a_generation_node_killed_between_calls_is_revived_and_its_lost_values_recomputed(job_dir: Path) -> None:
    # Both generators have answered; the reward holds its call while generator-0, idle, is
    # killed. The train call then needs generator-0's sequences: its handle moves to the node's
    # next incarnation and the executor generates the lost ones again.
    hold = job_dir.parent / "reward_pid"
    with build_job(job_dir, steps=1, generator_kwargs={}, reward_kwargs={"hold_first_call_in": str(hold)}) as master:
        master.start()
        wait_for(lambda: hold.exists() and hold.read_text(), 60, "the reward to hold its first call")
        victim = master.get_nodes_by_role()["generator"][0].pid
        os.kill(victim, signal.SIGKILL)
        hold.with_name(hold.name + ".go").write_text("")
        assert master.wait(timeout=scaled(120)) == JobState.STOPPED
        generators = master.get_nodes_by_role()["generator"]
        driver = master.get_nodes_by_role()["master"][0]
    assert [n.restarts for n in generators] == [1, 0] and driver.restarts == 0  # the step was not redone
    assert (job_dir / "driver_restarts.txt").read_text() == "1"
    assert trained(job_dir) == list(range(8))  # nothing lost, nothing trained twice
