"""FailurePolicy on frozen statuses: pure logic, no processes."""

from __future__ import annotations

import dataclasses

import pytest

from rlplex.control import (
    Action,
    DefaultFailurePolicy,
    JobState,
    JobStatus,
    NodeState,
    NodeStatus,
    RoleStatus,
    detect_failure,
)

HEALTHY = NodeStatus(
    node_id="w-0", role="w", rank=0, state=NodeState.RUNNING, alive=True, exit_code=None, reported="RUNNING",
    error=None, in_state_s=10.0, heartbeat_age_s=0.1, progress_age_s=0.5, restarts=0, heartbeat_timeout_s=2.0,
    progress_timeout_s=5.0, start_timeout_s=30.0,
)  # fmt: skip


def job(node: NodeStatus, scope: str = "worker", role_restarts: int = 0, job_restarts: int = 0) -> JobStatus:
    role = RoleStatus("w", "worker", scope, max_restarts=2, restarts=role_restarts)
    return JobStatus("j", JobState.RUNNING, job_restarts, max_restarts=3, roles=(role,), nodes=(node,))


@pytest.mark.parametrize(
    ("changes", "cause"),
    [
        ({"alive": False, "exit_code": -9}, "process exited (code -9) in state RUNNING"),
        ({"heartbeat_age_s": 2.5}, "no heartbeat for 2.5 s (timeout 2 s)"),
        ({"progress_age_s": 6.0}, "no progress for 6.0 s (timeout 5 s)"),
        ({"reported": "FAILED", "error": "ValueError: x"}, "worker reported failure: ValueError: x"),
        ({"state": NodeState.CREATED, "in_state_s": 31.0}, "not ready within its start timeout"),
    ],
)
def test_failures_are_detected_with_their_cause(changes: dict[str, object], cause: str) -> None:
    node = dataclasses.replace(HEALTHY, **changes)  # type: ignore[arg-type]
    found = detect_failure(node)
    assert found is not None and found.startswith(cause)


def test_healthy_finished_and_unbounded_progress_are_not_failures() -> None:
    assert detect_failure(HEALTHY) is None
    assert detect_failure(dataclasses.replace(HEALTHY, state=NodeState.FINISHED, alive=False)) is None
    assert detect_failure(dataclasses.replace(HEALTHY, progress_timeout_s=None, progress_age_s=1e6)) is None
    assert detect_failure(dataclasses.replace(HEALTHY, state=NodeState.CHECKED, heartbeat_age_s=99.0)) is None


@pytest.mark.parametrize(
    ("scope", "action"),
    [("worker", Action.RESTART_WORKER), ("role", Action.RESTART_ROLE), ("job", Action.RESTART_JOB),
     ("never", Action.FAIL_JOB)],
)  # fmt: skip
def test_decision_follows_the_role_scope(scope: str, action: Action) -> None:
    decision = DefaultFailurePolicy().decide(job(dataclasses.replace(HEALTHY, alive=False), scope=scope))
    assert decision.action == action
    assert "node w-0 (role 'w') failed: process exited" in decision.cause
    if action == Action.RESTART_WORKER:
        assert decision.node_ids == ("w-0",)


def test_budgets_turn_restarts_into_failure() -> None:
    dead = dataclasses.replace(HEALTHY, alive=False)
    role_spent = DefaultFailurePolicy().decide(job(dead, role_restarts=2))
    assert role_spent.action == Action.FAIL_JOB and "role 'w' exhausted its restart budget (2)" in role_spent.cause
    job_spent = DefaultFailurePolicy().decide(job(dead, job_restarts=3))
    assert job_spent.action == Action.FAIL_JOB and "the job exhausted its restart budget (3)" in job_spent.cause
    assert DefaultFailurePolicy().decide(job(HEALTHY)).action == Action.NONE
