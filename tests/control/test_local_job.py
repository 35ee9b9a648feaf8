"""Real local jobs: OS processes, sockets on 127.0.0.1, a real SQLite file."""

from __future__ import annotations

import ast
import os
import signal
from functools import partial
from pathlib import Path

import psutil
import pytest

from node_helpers import node_processes, wait_for
from rlplex.control import JobBuilder, JobState, LocalDataChannel, NodeState, PrimeMaster, SqliteStateStore
from rlplex.control.job.token import read_token
from rlplex.control.node.role_group import RoleGroup
from timing import scaled

pytestmark = pytest.mark.e2e


def items_done(job_dir: Path) -> list[int]:
    return sorted(int(x) for f in (job_dir / "items").glob("*.txt") for x in f.read_text().split())


def test_a_job_of_workers_runs_to_the_end(job_dir: Path) -> None:
    spec = (
        JobBuilder("count", job_dir, capacity={"cpu": 2})
        .role("counter", entrypoint="control_workers:Counter", count=3, resources={"cpu": 0.5},
              config={"items": 45, "delay_s": 0.01})
        .build()
    )  # fmt: skip
    master = PrimeMaster.create(spec)
    master.start()
    assert master.state == JobState.RUNNING
    nodes = master.get_nodes_by_role()["counter"]
    assert [n.rank for n in nodes] == [0, 1, 2] and all(n.pid > 0 and n.address for n in nodes)
    assert master.wait(timeout=scaled(30)) == JobState.STOPPED
    assert items_done(job_dir) == list(range(45))
    store = SqliteStateStore.in_dir(job_dir, create=False)
    states = [(n.node_id, n.state, n.restarts) for n in store.nodes(master.job_id)]
    assert states == [(f"counter-{i}", "FINISHED", 0) for i in range(3)]
    assert [n.progress["items"] for n in store.nodes(master.job_id)] == [15, 15, 15]
    journey = [r.new for r in store.transitions(master.job_id) if r.entity == "counter-1"]
    assert journey == ["CREATED", "CHECKED", "RUNNING", "FINISHED"]
    assert [r.new for r in store.transitions(master.job_id) if r.entity == "job"] == [
        "READY", "RUNNING", "STOPPING", "STOPPED"
    ]  # fmt: skip
    assert node_processes(job_dir) == []
    master.close()


def test_trainer_driven_driver_calls_role_groups(job_dir: Path) -> None:
    spec = (
        JobBuilder("drive", job_dir, capacity={"cpu": 2})
        .role("idle", entrypoint="control_workers:Idle", count=2, resources={"cpu": 0.5})
        .role("trainer", kind="driver", entrypoint="control_workers:drive", resources={"cpu": 0.5})
        .build()
    )
    with PrimeMaster.create(spec) as master:
        master.start()
        assert master.wait(timeout=scaled(30)) == JobState.STOPPED
        results, who, rank0 = ast.literal_eval((job_dir / "driver.txt").read_text())
        assert results == [2, 4, 6, 8]
        pids = {n.rank: n.pid for n in master.get_nodes_by_role()["idle"]}
        assert [w["rank"] for w in who] == [0, 1] and [w["pid"] for w in who] == [pids[0], pids[1]]
        assert rank0 == 30
        states = {n.node_id: n.state for ns in master.get_nodes_by_role().values() for n in ns}
        assert states == {"idle-0": NodeState.STOPPED, "idle-1": NodeState.STOPPED, "trainer-0": NodeState.FINISHED}


def test_a_role_scales_up_and_down_while_running(job_dir: Path) -> None:
    spec = (
        JobBuilder("scale", job_dir, capacity={"cpu": 2})
        .role("idle", entrypoint="control_workers:Idle", count=1, resources={"cpu": 0.5},
              restart={"scope": "worker", "max_restarts": 1, "per_node": 2})
        .build()
    )  # fmt: skip
    with PrimeMaster.create(spec) as master:
        master.start()
        job_budget = master.manager.status().max_restarts

        def running() -> list[str]:
            master.monitor()
            return [n.node_id for n in master.get_nodes_by_role()["idle"] if n.state == NodeState.RUNNING]

        master.scale_role("idle", 3)
        wait_for(lambda: len(running()) == 3, 20, "3 idle nodes RUNNING")
        # Two nodes gained, two restarts each (issue 31, hole 4: a run added later brings its budget).
        assert master.manager.status().role("idle").max_restarts == 1 + 2 * 2
        assert master.manager.status().max_restarts == job_budget + 2 * 2
        first_pid = master.get_nodes_by_role()["idle"][0].pid
        master.scale_role("idle", 1)
        assert running() == ["idle-0"]
        assert master.manager.status().role("idle").max_restarts == 5  # a scaled-down node may come back
        assert master.get_nodes_by_role()["idle"][0].pid == first_pid
        assert len(node_processes(job_dir)) == 1
        master.stop()
        assert master.state == JobState.STOPPED


def test_nodes_fork_from_one_server_that_imported_the_preload_once(
    job_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = job_dir / "imported_by.txt"
    monkeypatch.setenv("RLPLEX_TEST_PRELOAD_PROBE", str(probe))
    spec = (
        JobBuilder("preload", job_dir, capacity={"cpu": 2}, preload=["preload_probe", "numpy.random", "torch"])
        .role("idle", entrypoint="control_workers:PreloadedIdle", count=2, resources={"cpu": 0.5},
              restart={"scope": "worker", "max_restarts": 1})
        .build()
    )  # fmt: skip
    with PrimeMaster.create(spec) as master:
        master.start()
        nodes = node_processes(job_dir)
        assert len(nodes) == 2
        (server,) = {node.ppid() for node in nodes}
        # The probe ran once, in the server; the nodes found it imported.
        assert probe.read_text().split() == [str(server)]
        assert all(os.getsid(node.pid) == node.pid for node in nodes)  # each leads its own session
        assert nodes[0].cmdline()[1:] == [
            "-m", "rlplex.control.node.runtime", "--output-dir", str(job_dir), "--job-id", master.job_id,
            "--node-id", nodes[0].cmdline()[8], "--incarnation", "0",
        ]  # fmt: skip
        # Each node has random states of its own, as a process started afresh would.
        group = RoleGroup.of_job(job_dir, master.job_id, read_token(job_dir), "idle")
        try:
            first, second = (future.result(timeout=scaled(30)) for future in group.call("draws"))
        finally:
            group.close()
        assert first[0] != second[0] and first[1] != second[1]
        # A node killed is restarted from the same server, warm: still one import.
        victim = master.get_nodes_by_role()["idle"][1].pid
        os.kill(victim, signal.SIGKILL)

        def restarted() -> bool:
            master.monitor()
            node = master.get_nodes_by_role()["idle"][1]
            return node.pid != victim and node.state == NodeState.RUNNING

        wait_for(restarted, scaled(20), "idle-1 restarted")
        assert psutil.Process(master.get_nodes_by_role()["idle"][1].pid).ppid() == server
        assert probe.read_text().split() == [str(server)]
        cause = [t.cause for t in master.store.transitions(master.job_id) if t.entity == "idle-1" and t.new == "FAILED"]
        assert cause and "process exited (code -9)" in cause[0]
        master.stop()
    assert not psutil.pid_exists(server) or psutil.Process(server).status() == psutil.STATUS_ZOMBIE


def test_nodes_stop_themselves_when_no_master_comes_back(job_dir: Path) -> None:
    spec = (
        JobBuilder("orphan", job_dir, capacity={"cpu": 2}, heartbeat_interval_s=0.1, master_lost_timeout_s=1.0)
        .role("idle", entrypoint="control_workers:Idle", count=2, resources={"cpu": 0.5})
        .build()
    )
    master = PrimeMaster.create(spec)
    master.start()
    assert len(node_processes(job_dir)) == 2
    master.manager.scheduler.detach()  # type: ignore[attr-defined]  # the master "dies": its listener is gone
    wait_for(lambda: node_processes(job_dir) == [], 10, "nodes without a master to exit")
    master.close()


def test_the_end_of_a_job_removes_its_channels(job_dir: Path) -> None:
    other = LocalDataChannel.create(f"not-the-job-{os.getpid()}", capacity=1, slot_bytes=256)
    try:
        for fail in (False, True):
            out = job_dir / str(fail)
            spec = (
                JobBuilder("channels", out, capacity={"cpu": 2})
                .role("owner", entrypoint="control_workers:channel_owner", resources={"cpu": 0.5})
                .role("idle", entrypoint="control_workers:Idle", resources={"cpu": 0.5})
                .build()
            )
            with PrimeMaster.create(spec) as master:
                master.start()
                name = str(wait_for(partial(_read, out / "channel.txt"), 30, "the channel's name"))
                assert name.startswith(f"{master.job_id}.")
                reader = LocalDataChannel.attach(name)
                assert reader.get(timeout=5) == {"item": 1}  # it outlived its creator
                reader.detach()
                if fail:
                    master.manager.fail("failed by the test")
                else:
                    master.stop("stopped by the test")
            assert sorted(Path("/dev/shm").glob(f"rlplex-ch-{master.job_id}*")) == []
        assert Path(f"/dev/shm/rlplex-ch-not-the-job-{os.getpid()}").exists()
    finally:
        other.unlink()


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""
