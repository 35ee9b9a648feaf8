"""Health as data: frozen statuses in, a `Decision` out.

The manager builds a `JobStatus` once per `monitor()` step; a `FailurePolicy` reads it and
returns one `Decision` with its cause; the manager carries it out and records it. A node has
failed when it exited before finishing, reported a failure, missed its start deadline, sent
no heartbeat within `heartbeat_timeout_s`, or kept its progress counters unchanged for
`progress_timeout_s` (a hang is a failure, like a crash).

Default policy: restart what the failed node's role asks for (worker, role or job) while the
role's and the job's restart budgets last; otherwise fail the job, saying which budget ran out.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from rlplex.control.job.states import JobState, NodeState


class Action(StrEnum):
    NONE = "NONE"
    RESTART_WORKER = "RESTART_WORKER"
    RESTART_ROLE = "RESTART_ROLE"
    RESTART_JOB = "RESTART_JOB"
    FAIL_JOB = "FAIL_JOB"


@dataclass(frozen=True)
class NodeStatus:
    node_id: str
    role: str
    rank: int
    state: NodeState
    alive: bool
    exit_code: int | None
    reported: str  # the worker's own status(): CREATED, RUNNING, FINISHED, FAILED
    error: str | None
    in_state_s: float
    heartbeat_age_s: float
    progress_age_s: float
    restarts: int
    heartbeat_timeout_s: float
    progress_timeout_s: float | None
    start_timeout_s: float


@dataclass(frozen=True)
class RoleStatus:
    name: str
    kind: str
    scope: str  # worker | role | job | never
    max_restarts: int
    restarts: int


@dataclass(frozen=True)
class JobStatus:
    job_id: str
    state: JobState
    restarts: int
    max_restarts: int
    roles: tuple[RoleStatus, ...]
    nodes: tuple[NodeStatus, ...]

    def role(self, name: str) -> RoleStatus:
        return next(r for r in self.roles if r.name == name)


@dataclass(frozen=True)
class Decision:
    action: Action
    cause: str = ""
    role: str | None = None
    node_ids: tuple[str, ...] = ()


NO_DECISION = Decision(Action.NONE)


def detect_failure(node: NodeStatus) -> str | None:
    """Why this node counts as failed now, or None when it is healthy (or not running)."""
    if node.state not in (NodeState.CREATED, NodeState.CHECKED, NodeState.RUNNING):
        return None
    if node.reported == NodeState.FAILED:
        return f"worker reported failure: {node.error or 'no reason given'}"
    if not node.alive:
        code = "unknown" if node.exit_code is None else str(node.exit_code)
        return f"process exited (code {code}) in state {node.state.value}"
    if node.state == NodeState.CREATED and node.in_state_s > node.start_timeout_s:
        return f"not ready within its start timeout ({node.start_timeout_s:g} s)"
    if node.state == NodeState.RUNNING:
        if node.heartbeat_age_s > node.heartbeat_timeout_s:
            return f"no heartbeat for {node.heartbeat_age_s:.1f} s (timeout {node.heartbeat_timeout_s:g} s)"
        timeout = node.progress_timeout_s
        if timeout is not None and node.progress_age_s > timeout:
            return f"no progress for {node.progress_age_s:.1f} s (timeout {timeout:g} s)"
    return None


class FailurePolicy(Protocol):
    def decide(self, status: JobStatus) -> Decision: ...


class DefaultFailurePolicy:
    """Role scope and budgets as declared in the job; the first failed node decides this step."""

    def decide(self, status: JobStatus) -> Decision:
        for node in status.nodes:
            cause = detect_failure(node)
            if cause is None:
                continue
            what = f"node {node.node_id} (role '{node.role}') failed: {cause}"
            role = status.role(node.role)
            if role.scope == "never":
                return Decision(Action.FAIL_JOB, f"{what}; role '{role.name}' never restarts", role.name)
            if role.restarts >= role.max_restarts:
                return Decision(
                    Action.FAIL_JOB,
                    f"{what}; role '{role.name}' exhausted its restart budget ({role.max_restarts})",
                    role.name,
                )
            if status.restarts >= status.max_restarts:
                return Decision(
                    Action.FAIL_JOB, f"{what}; the job exhausted its restart budget ({status.max_restarts})", role.name
                )
            if role.scope == "role":
                return Decision(Action.RESTART_ROLE, what, role.name)
            if role.scope == "job":
                return Decision(Action.RESTART_JOB, what, role.name)
            return Decision(Action.RESTART_WORKER, what, role.name, (node.node_id,))
        return NO_DECISION
