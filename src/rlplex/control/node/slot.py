"""The master's live view of one node: its state machine, handle, RPC client and last heartbeat."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rlplex.control.backends.scheduler import NodeClient, NodeHandle
from rlplex.control.job.placement import node_id
from rlplex.control.job.states import NodeState, StateMachine, node_machine
from rlplex.control.job.store import NodeRecord, StateStore


@dataclass(frozen=True)
class NodeInfo:
    """A node in the registry (`get_nodes_by_role`)."""

    node_id: str
    role: str
    rank: int
    state: NodeState
    pid: int
    address: str
    restarts: int
    progress: dict[str, Any]


@dataclass
class NodeSlot:
    node_id: str
    role: str
    rank: int
    kind: str
    machine: StateMachine[NodeState]
    incarnation: int = 0
    restarts: int = 0
    since: float = field(default_factory=time.monotonic)
    handle: NodeHandle | None = None
    client: NodeClient | None = None
    address: str = ""
    connected: bool = False
    reported: str = NodeState.CREATED
    error: str | None = None
    progress: dict[str, Any] = field(default_factory=dict)
    last_heartbeat: float = field(default_factory=time.monotonic)
    progress_changed: float = field(default_factory=time.monotonic)
    heartbeat_wall: float = 0.0
    dirty: bool = False

    @classmethod
    def new(cls, store: StateStore, job_id: str, role: str, rank: int, kind: str) -> NodeSlot:
        nid = node_id(role, rank)
        return cls(nid, role, rank, kind, node_machine(store, job_id, nid))

    @classmethod
    def from_record(cls, store: StateStore, record: NodeRecord, kind: str) -> NodeSlot:
        machine = node_machine(store, record.job_id, record.node_id, NodeState(record.state))
        return cls(
            record.node_id, record.role, record.rank, kind, machine, record.incarnation, record.restarts,
            progress=record.progress, heartbeat_wall=record.last_heartbeat,
        )  # fmt: skip

    @property
    def state(self) -> NodeState:
        return self.machine.state

    def to(self, state: NodeState, cause: str) -> None:
        self.machine.transition(state, cause)
        self.since = time.monotonic()

    def launched(self, handle: NodeHandle, store: StateStore, job_id: str) -> None:
        self.handle = handle
        # One transaction: a resumed master must never see CREATED without the pid to watch.
        with store.transaction():
            store.update_node(
                job_id, self.node_id, pid=handle.pid, create_time=handle.create_time, incarnation=self.incarnation,
                restarts=self.restarts, address="",
            )  # fmt: skip
            self.to(NodeState.CREATED, f"process launched (pid {handle.pid}, incarnation {self.incarnation})")
        self.last_heartbeat = self.progress_changed = time.monotonic()

    def heartbeat(self, payload: dict[str, Any], at: float) -> None:
        self.last_heartbeat = at
        self.heartbeat_wall = time.time()
        self.reported = str(payload.get("status", self.reported))
        self.error = payload.get("error") or self.error
        progress = payload.get("progress") or {}
        if progress != self.progress:
            self.progress = progress
            self.progress_changed = at
        self.dirty = True

    def reset_for_restart(self, count: bool = True) -> None:
        """Forget the old process; `count=False` for a scale-up reusing a stopped rank (not a restart)."""
        if self.client is not None:
            self.client.close()
        self.client, self.address, self.connected = None, "", False
        self.reported, self.error = NodeState.CREATED, None
        self.incarnation += 1
        self.restarts += int(count)

    def info(self) -> NodeInfo:
        pid = self.handle.pid if self.handle is not None else 0
        return NodeInfo(
            self.node_id, self.role, self.rank, self.state, pid, self.address, self.restarts, dict(self.progress)
        )
