"""The `Scheduler` protocol: how the manager creates, watches, reaches and removes nodes.

A backend (local processes, Ray actors) implements it; the manager knows nothing else of the
backend. Node events (hello, heartbeat, final, closed) are pushed by the nodes and drained by
the manager once per `monitor()` step through `events()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rlplex.control.job.placement import Bundle


@dataclass
class NodeHandle:
    """A node as a backend knows it. `ref` is the backend's own object (the node fork server, an actor handle)."""

    node_id: str
    role: str
    rank: int
    incarnation: int
    pid: int = 0
    create_time: float = 0.0
    bundle: int = -1
    ref: Any = field(default=None, repr=False)


@dataclass(frozen=True)
class NodeEvent:
    """kind: 'hello' (payload: pid, address), 'heartbeat' / 'final' (status, progress, error), 'closed'."""

    kind: str
    node_id: str
    incarnation: int
    payload: dict[str, Any]
    at: float


class NodeClient(Protocol):
    """The control RPC to one node: `status`, `self_check`, `check_child`, `start`, `stop`, `call`."""

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any: ...
    def close(self) -> None: ...


class Scheduler(Protocol):
    master_address: str

    def create_nodes(self, bundles: list[Bundle], incarnations: dict[str, int]) -> list[NodeHandle]:
        """Launch one node per bundle member (non-blocking: nodes say hello through `events()`)."""
        ...

    def restart(self, handle: NodeHandle, incarnation: int) -> NodeHandle:
        """Kill the node if alive and launch it again in the same bundle."""
        ...

    def attach(self, node_id: str, role: str, rank: int, incarnation: int, pid: int, create_time: float) -> NodeHandle:
        """Re-attach to a node started by a previous master (resume); `is_alive` says if it still lives."""
        ...

    def is_alive(self, handle: NodeHandle) -> bool: ...
    def exit_code(self, handle: NodeHandle) -> int | None: ...
    def kill(self, handle: NodeHandle) -> None: ...
    def client(self, handle: NodeHandle, address: str) -> NodeClient: ...
    def events(self) -> list[NodeEvent]: ...
    def acknowledge(self, node_id: str, incarnation: int) -> bool:
        """Tell the node its final message is stored, so that it may exit (False: not connected now)."""
        ...

    def log_tail(self, handle: NodeHandle, lines: int = 5) -> str: ...
    def cleanup(self) -> None:
        """Kill every node this scheduler knows and release its resources; leaves no process behind."""
        ...


def read_log_tail(log_dir: Path, node_id: str, lines: int = 5) -> str:
    """The last `lines` lines of a node's log, joined on one line ('' when there is none yet)."""
    try:
        text = (log_dir / f"{node_id}.log").read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])
