"""The job's and each node's life as explicit state machines.

Job:   INIT -> READY -> RUNNING -> STOPPING -> STOPPED, any live state -> FAILED.
       Failover (job restart, master resume) goes RUNNING -> READY -> RUNNING.
Node:  PENDING   registered, no process yet
       CREATED   process launched, not yet answered status() / self_check()
       CHECKED   answered status(), passed self_check() (and check_child() on sub-masters)
       RUNNING   start() returned
       FINISHED  its work is done (reported by the node)
       FAILED    exited, crashed, hung or failed a check; the cause is recorded
       STOPPED   stopped by the master (job end, scale down)
       FAILED / STOPPED / FINISHED -> PENDING when the node is restarted.

`StateMachine.transition` checks the table, then records the step (time and cause) in the
store within one transaction; an illegal step raises `IllegalTransitionError`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Generic, Protocol, TypeVar

from rlplex.errors import IllegalTransitionError


class JobState(StrEnum):
    INIT = "INIT"
    READY = "READY"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    FAILED = "FAILED"


class NodeState(StrEnum):
    PENDING = "PENDING"
    CREATED = "CREATED"
    CHECKED = "CHECKED"
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"


J, N = JobState, NodeState

JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    J.INIT: frozenset({J.READY, J.FAILED, J.STOPPED}),
    J.READY: frozenset({J.RUNNING, J.STOPPING, J.FAILED}),
    J.RUNNING: frozenset({J.READY, J.STOPPING, J.FAILED}),
    J.STOPPING: frozenset({J.STOPPED, J.FAILED}),
    J.STOPPED: frozenset(),
    J.FAILED: frozenset(),
}

NODE_TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    N.PENDING: frozenset({N.CREATED, N.FAILED, N.STOPPED}),
    N.CREATED: frozenset({N.CHECKED, N.FAILED, N.STOPPED}),
    N.CHECKED: frozenset({N.RUNNING, N.FINISHED, N.FAILED, N.STOPPED}),
    N.RUNNING: frozenset({N.FINISHED, N.FAILED, N.STOPPED}),
    N.FINISHED: frozenset({N.PENDING, N.STOPPED}),
    N.FAILED: frozenset({N.PENDING, N.STOPPED}),
    N.STOPPED: frozenset({N.PENDING}),
}

LIVE_NODE_STATES = frozenset({N.CREATED, N.CHECKED, N.RUNNING})
TERMINAL_JOB_STATES = frozenset({J.STOPPED, J.FAILED})


class WorkDone(StrEnum):
    """The causes with which a job ends because its work is done, not because anyone stopped it."""

    DRIVERS_FINISHED = "every driver finished"
    NODES_FINISHED = "every node finished"


def job_outcome(state: str, cause: str) -> str:
    """A job's state as users read it, the same in every command and report: FINISHED (its work
    done), STOPPED and by whom ("STOPPED by SIGINT"), or the state itself (RUNNING, FAILED ...).
    The store keeps STOPPED for both ends: the state machine has one way out of STOPPING."""
    if state != J.STOPPED:
        return str(state)
    if cause in set(WorkDone):
        return "FINISHED"
    if cause.startswith("stopped by "):
        return f"STOPPED {cause.removeprefix('stopped ')}"
    return f"STOPPED ({cause})" if cause else "STOPPED"


S = TypeVar("S", bound=StrEnum)


class TransitionLog(Protocol):
    """Where transitions are recorded (the `StateStore`)."""

    def record_transition(self, job_id: str, entity: str, old: str, new: str, cause: str) -> None: ...


class StateMachine(Generic[S]):
    """One entity's state (`entity` is 'job' or a node id) checked against a transition table."""

    def __init__(
        self, table: dict[S, frozenset[S]], state: S, log: TransitionLog | None, job_id: str, entity: str
    ) -> None:
        self._table: dict[S, frozenset[S]] = table
        self._state: S = state
        self._log, self.job_id, self.entity = log, job_id, entity

    @property
    def state(self) -> S:
        return self._state

    def can(self, new: S) -> bool:
        return new in self._table[self._state]

    def transition(self, new: S, cause: str) -> None:
        if not self.can(new):
            raise IllegalTransitionError(
                f"{self.entity}: illegal transition {self._state.value} -> {new.value} (cause: {cause}); "
                f"allowed: {sorted(s.value for s in self._table[self._state]) or 'none'}"
            )
        if self._log is not None:
            self._log.record_transition(self.job_id, self.entity, self._state.value, new.value, cause)
        self._state = new


def job_machine(log: TransitionLog | None, job_id: str, state: JobState = J.INIT) -> StateMachine[JobState]:
    return StateMachine(JOB_TRANSITIONS, state, log, job_id, "job")


def node_machine(
    log: TransitionLog | None, job_id: str, node_id: str, state: NodeState = N.PENDING
) -> StateMachine[NodeState]:
    return StateMachine(NODE_TRANSITIONS, state, log, job_id, node_id)
