from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from rlplex.control import JobState, NodeState, SqliteStateStore
from rlplex.control.job.states import job_machine, node_machine
from rlplex.errors import IllegalTransitionError


def test_job_lifecycle_with_failover_is_recorded(tmp_path: Path) -> None:
    store = SqliteStateStore(tmp_path / "job.sqlite")
    store.create_job("j1", "demo", "{}")
    job = job_machine(store, "j1")
    steps = [
        (JobState.READY, "prepared"),
        (JobState.RUNNING, "started"),
        (JobState.READY, "failover"),
        (JobState.RUNNING, "failover done"),
        (JobState.STOPPING, "drivers finished"),
        (JobState.STOPPED, "all stopped"),
    ]
    for state, cause in steps:
        job.transition(state, cause)
        assert store.job("j1").state == state.value
    log = store.transitions("j1")
    assert [(r.new, r.cause) for r in log] == [(s.value, c) for s, c in steps]
    assert log[0].old == "INIT" and all(a.at <= b.at for a, b in itertools.pairwise(log))


@pytest.mark.parametrize(
    ("start", "illegal"),
    [(JobState.INIT, JobState.RUNNING), (JobState.STOPPED, JobState.RUNNING), (JobState.FAILED, JobState.READY)],
)
def test_illegal_job_transition_raises_and_records_nothing(tmp_path: Path, start: JobState, illegal: JobState) -> None:
    store = SqliteStateStore(tmp_path / "job.sqlite")
    store.create_job("j1", "demo", "{}")
    job = job_machine(store, "j1", start)
    with pytest.raises(IllegalTransitionError, match=f"{start.value} -> {illegal.value}"):
        job.transition(illegal, "test")
    assert job.state == start and store.transitions("j1") == []


def test_node_steps_one_at_a_time(tmp_path: Path) -> None:
    store = SqliteStateStore(tmp_path / "job.sqlite")
    store.create_job("j1", "demo", "{}")
    store.add_node("j1", "w-0", "w", 0, "PENDING")
    node = node_machine(store, "j1", "w-0")
    for state in (NodeState.CREATED, NodeState.CHECKED, NodeState.RUNNING, NodeState.FAILED, NodeState.PENDING):
        node.transition(state, f"to {state.value}")
        assert store.nodes("j1")[0].state == state.value
        assert store.nodes("j1")[0].cause == f"to {state.value}"
    with pytest.raises(IllegalTransitionError):
        node.transition(NodeState.RUNNING, "skipping the checks")
    assert not node.can(NodeState.FINISHED)
