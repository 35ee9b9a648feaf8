"""The master's end of the heartbeats: a listener on 127.0.0.1 that nodes connect back to.

An `AuthListener` accepts (with the job token as HMAC key, each handshake off the accepting
thread, so an idle client blocks nobody), one thread reads every connection through
one epoll set, so the cost does not grow with a thread per node. Messages
become `NodeEvent`s in arrival order; a connection's end becomes a 'closed' event, which is
ordered after the node's last message (a dead node is seen within one read).

A node's final message is acknowledged only when the manager says so (`acknowledge`), after it
has stored what the message says: a node exits on the acknowledgement, so a master that dies
between reading and storing must not have acknowledged (the node then tells the resumed master).
"""

from __future__ import annotations

import selectors
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from rlplex.control.backends.scheduler import NodeEvent
from rlplex.control.rpc import AuthListener, format_address, recv_message, send_message
from rlplex.errors import NodeFailedError

_POLL_S = 0.1
_COALESCE_S = 0.1


class HeartbeatServer:
    def __init__(self, authkey: bytes, host: str = "127.0.0.1") -> None:
        self._lock = threading.Lock()
        self._new: list[Connection] = []
        self._who: dict[Connection, tuple[str, int]] = {}
        self._conn_of: dict[tuple[str, int], Connection] = {}  # the latest connection of each node
        self._events: list[NodeEvent] = []
        self._closed = threading.Event()
        self._listener = AuthListener(host, authkey, self._accepted, name="heartbeat")
        self.address = format_address(self._listener.address)
        self._reader = threading.Thread(target=self._read_loop, name="heartbeat-read", daemon=True)
        self._reader.start()

    def _accepted(self, conn: Connection) -> None:
        with self._lock:
            self._new.append(conn)

    def _push(self, kind: str, who: tuple[str, int], payload: dict[str, Any]) -> None:
        with self._lock:
            self._events.append(NodeEvent(kind, who[0], who[1], payload, time.monotonic()))

    def _read_loop(self) -> None:
        # One epoll set kept across reads: `multiprocessing.connection.wait` would rebuild it
        # for every message, which costs more than the message itself with 64 nodes.
        selector = selectors.DefaultSelector()
        while not self._closed.is_set():
            with self._lock:
                fresh, self._new = self._new, []
            for conn in fresh:
                selector.register(conn, selectors.EVENT_READ, data=conn)
            if not selector.get_map():
                self._closed.wait(_POLL_S)
                continue
            for key, _ in selector.select(timeout=_POLL_S):
                conn = key.data
                try:
                    message = recv_message(conn, None, "node")
                except NodeFailedError:  # gone, or not our protocol
                    self._drop(conn, selector)
                    continue
                if not isinstance(message, dict):
                    self._drop(conn, selector)
                    continue
                if message.get("type") == "hello":
                    who = (str(message["node_id"]), int(message["incarnation"]))
                    with self._lock:
                        self._who[conn] = who
                        self._conn_of[who] = conn
                with self._lock:
                    known = self._who.get(conn)
                if known is None:
                    self._drop(conn, selector)
                    continue
                self._push(str(message.get("type")), known, message)
            # Let messages pile up a little: one wake-up then reads several heartbeats, which
            # keeps the idle master cheap with many nodes (costs at most this much latency).
            self._closed.wait(_COALESCE_S)
        selector.close()

    def _drop(self, conn: Connection, selector: selectors.BaseSelector) -> None:
        selector.unregister(conn)
        # Closed under the lock: `acknowledge` sends under it, never to a descriptor closed (and reused) meanwhile.
        with self._lock:
            who = self._who.pop(conn, None)
            if who is not None and self._conn_of.get(who) is conn:
                del self._conn_of[who]
            conn.close()
        if who is not None:
            self._push("closed", who, {})

    def acknowledge(self, node_id: str, incarnation: int) -> bool:
        """Tell a node its final message is stored (it exits then); False when it is not connected."""
        with self._lock:
            conn = self._conn_of.get((node_id, incarnation))
            if conn is None:
                return False
            try:
                send_message(conn, {"type": "ack"})
            except (OSError, ValueError):  # gone meanwhile: it sends its final again to whoever is master
                return False
        return True

    def events(self) -> list[NodeEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        self._reader.join(timeout=2.0)
        with self._lock:
            conns = list(self._who)
        for conn in conns:
            conn.close()
