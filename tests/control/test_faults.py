"""Faults on real processes: crashes, hangs, exhausted budgets, failing checks.

Faults are injected from outside (signals sent by the test) or by the test workers reading
RLPLEX_TEST_FAULTS; the product has no fault code path.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from node_helpers import node_processes, wait_for
from rlplex.control import JobBuilder, JobSpec, JobState, PrimeMaster, SqliteStateStore
from rlplex.errors import JobFailedError
from timing import scaled

pytestmark = pytest.mark.e2e


def counter_job(job_dir: Path, items: int = 60, delay_s: float = 0.03, **role: Any) -> JobSpec:
    return (
        JobBuilder("faults", job_dir, capacity={"cpu": 2}, heartbeat_interval_s=0.1)
        .role("counter", entrypoint="control_workers:Counter", count=3, resources={"cpu": 0.5},
              config={"items": items, "delay_s": delay_s}, **role)
        .build()
    )  # fmt: skip


def items_done(job_dir: Path) -> set[int]:
    return {int(x) for f in (job_dir / "items").glob("*.txt") for x in f.read_text().split()}


def progress_of(master: PrimeMaster, node_id: str) -> float:
    master.monitor()
    node = next(n for n in master.get_nodes_by_role()["counter"] if n.node_id == node_id)
    return float(node.progress.get("items", 0))


def decisions(master: PrimeMaster) -> list[tuple[str, str, str]]:
    return [(d.old, d.entity, d.cause) for d in master.store.decisions(master.job_id)]


@pytest.mark.parametrize("scope", ["worker", "role", "job"])
def test_sigkilled_worker_is_restarted_and_nothing_is_lost(job_dir: Path, scope: str) -> None:
    with PrimeMaster.create(counter_job(job_dir, restart={"scope": scope})) as master:
        master.start()
        wait_for(lambda: progress_of(master, "counter-1") >= 3, 20, "counter-1 to process 3 items")
        victim = master.get_nodes_by_role()["counter"][1].pid
        os.kill(victim, signal.SIGKILL)
        assert master.wait(timeout=scaled(40)) == JobState.STOPPED
        assert items_done(job_dir) == set(range(60))
        nodes = {n.node_id: n for n in master.store.nodes(master.job_id)}
        assert nodes["counter-1"].restarts == 1 and nodes["counter-1"].pid != victim
        ((action, target, cause),) = decisions(master)
        assert "node counter-1 (role 'counter') failed: process exited (code -9)" in cause
        job_steps = [r.new for r in master.store.transitions(master.job_id) if r.entity == "job"]
        if scope == "worker":
            assert (action, target) == ("RESTART_WORKER", "counter-1")
            assert nodes["counter-0"].restarts == 0 and nodes["counter-2"].restarts == 0
        else:
            # Nodes that finished before the failure are not redone; the others restart with it.
            restarted = {n for n, rec in nodes.items() if rec.restarts == 1}
            assert restarted == set(nodes) and (action, target) == (f"RESTART_{scope.upper()}", "counter")
        failover = ["READY", "RUNNING", "READY", "RUNNING", "STOPPING", "STOPPED"]
        assert job_steps == (failover if scope == "job" else ["READY", "RUNNING", "STOPPING", "STOPPED"])
        assert master.store.job(master.job_id).restarts == 1


def test_a_slow_check_of_a_restarted_node_blames_no_other_node(job_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The master checks a restarted node with a blocking call (self_check may load a model). The
    # heartbeats the other nodes sent meanwhile count: none of them is silent for 3 s.
    monkeypatch.setenv("RLPLEX_TEST_FAULTS", "slow_check@counter-1")
    spec = counter_job(job_dir, items=30, delay_s=0.01)
    spec.roles["counter"].config.update(hold_until="go", hold_after=3)
    with PrimeMaster.create(spec) as master:
        master.start()
        wait_for(lambda: progress_of(master, "counter-1") >= 3, 20, "counter-1 to process 3 items")
        os.kill(master.get_nodes_by_role()["counter"][1].pid, signal.SIGKILL)

        def restarted_and_running() -> bool:
            master.monitor()
            node = next(n for n in master.get_nodes_by_role()["counter"] if n.node_id == "counter-1")
            return node.restarts == 1 and node.state == "RUNNING"

        wait_for(restarted_and_running, 30, "counter-1 restarted and RUNNING")
        (job_dir / "go").write_text("")
        assert master.wait(timeout=scaled(40)) == JobState.STOPPED
        assert [(action, target) for action, target, _ in decisions(master)] == [("RESTART_WORKER", "counter-1")]
        assert items_done(job_dir) == set(range(30))


def test_a_stopped_worker_misses_heartbeats_and_is_replaced(job_dir: Path) -> None:
    with PrimeMaster.create(counter_job(job_dir, heartbeat_timeout_s=1.0)) as master:
        master.start()
        wait_for(lambda: progress_of(master, "counter-2") >= 2, 20, "counter-2 to process 2 items")
        hung = master.get_nodes_by_role()["counter"][2].pid
        os.kill(hung, signal.SIGSTOP)  # alive, but silent: a hang
        assert master.wait(timeout=scaled(40)) == JobState.STOPPED
        assert items_done(job_dir) == set(range(60))
        ((action, target, cause),) = decisions(master)
        assert (action, target) == ("RESTART_WORKER", "counter-2") and "no heartbeat for" in cause


def test_a_worker_without_progress_is_a_hang(job_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPLEX_TEST_FAULTS", "stall@counter-0")
    with PrimeMaster.create(counter_job(job_dir, items=30, progress_timeout_s=1.0)) as master:
        master.start()
        assert master.wait(timeout=scaled(40)) == JobState.STOPPED
        assert items_done(job_dir) == set(range(30))
        ((action, target, cause),) = decisions(master)
        assert (action, target) == ("RESTART_WORKER", "counter-0") and "no progress for" in cause


def test_exhausted_restart_budget_fails_the_job_and_leaves_nothing(
    job_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLPLEX_TEST_FAULTS", "crash@counter-0")
    with PrimeMaster.create(counter_job(job_dir, restart={"max_restarts": 2})) as master:
        master.start()
        with pytest.raises(JobFailedError, match=r"role 'counter' exhausted its restart budget \(2\)"):
            master.wait(timeout=scaled(40))
        assert master.state == JobState.FAILED
        assert node_processes(job_dir) == []
        job = master.store.job(master.job_id)
        assert job.state == "FAILED" and "injected crash" in job.cause and "restart budget" in job.cause
        assert [d[0] for d in decisions(master)] == ["RESTART_WORKER", "RESTART_WORKER", "FAIL_JOB"]
        assert "exhausted its restart budget" in (job_dir / "master.log").read_text()
        assert {n.state for n in master.store.nodes(master.job_id)} <= {"STOPPED", "FINISHED"}


@pytest.mark.parametrize(
    ("fault", "role", "needle"),
    [
        ("self_check@counter-1", "counter", "injected self_check failure: disk not writable"),
        ("check_child@sub-0", "sub", "injected check_child failure: child rank 1 unreachable"),
    ],
)
def test_failing_checks_fail_prepare_and_clean_up(
    job_dir: Path, monkeypatch: pytest.MonkeyPatch, fault: str, role: str, needle: str
) -> None:
    monkeypatch.setenv("RLPLEX_TEST_FAULTS", fault)
    spec = (
        JobBuilder("checks", job_dir, capacity={"cpu": 2})
        .role("counter", entrypoint="control_workers:Counter", count=2, resources={"cpu": 0.5})
        .role("sub", kind="submaster", entrypoint="control_workers:Sub", resources={"cpu": 0.5})
        .build()
    )
    master = PrimeMaster.create(spec)
    with pytest.raises(JobFailedError, match=needle):
        master.start()
    assert node_processes(job_dir) == []
    store = SqliteStateStore.in_dir(job_dir, create=False)
    job = store.job(master.job_id)
    assert job.state == "FAILED" and needle in job.cause and f"{role}-" in job.cause
    assert all(n.state == "STOPPED" for n in store.nodes(master.job_id))
    master.close()
