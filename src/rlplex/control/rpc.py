"""Control RPC between our processes: JSON over HMAC-authenticated `multiprocessing.connection`.

Payloads are JSON (never pickle), sent with `send_bytes`. Every wait has a timeout; connecting
runs in a helper thread because the HMAC handshake of `Client` has no timeout of its own and a
stopped peer (SIGSTOP) would otherwise block the master forever. For the same reason the
serving side is `AuthListener`, not `multiprocessing.connection.Listener`: the listener's
`accept()` runs the handshake on the accepting thread, so one client that connects and sends
nothing would lock every other client out.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from typing import Any

from rlplex.errors import NodeFailedError, WaitTimeoutError

Address = tuple[str, int]


def send_json(conn: Connection, message: Any) -> None:
    conn.send_bytes(json.dumps(message).encode())


def recv_json(conn: Connection, timeout_s: float, what: str) -> Any:
    if not conn.poll(timeout_s):
        raise WaitTimeoutError(f"no message from {what} within {timeout_s:g} s")
    return json.loads(conn.recv_bytes())


def parse_address(text: str) -> Address:
    host, _, port = text.rpartition(":")
    return host, int(port)


def format_address(address: Any) -> str:
    host, port = address
    return f"{host}:{port}"


def connect(address: Address, authkey: bytes, timeout_s: float, what: str) -> Connection:
    result: dict[str, Any] = {}

    def attempt() -> None:
        try:
            result["conn"] = Client(address, authkey=authkey)
        except BaseException as error:
            result["error"] = error

    thread = threading.Thread(target=attempt, name=f"connect-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise WaitTimeoutError(f"connecting to {what} at {format_address(address)} took over {timeout_s:g} s")
    if "error" in result:
        raise NodeFailedError(f"cannot connect to {what} at {format_address(address)}: {result['error']}")
    conn: Connection = result["conn"]
    return conn


class RpcClient:
    """Calls `method(*args, **kwargs)` on a node; thread-safe (one call at a time per connection)."""

    def __init__(self, address: Address, authkey: bytes, name: str, timeout_s: float = 10.0) -> None:
        self.name, self.address, self.timeout_s = name, address, timeout_s
        self._conn = connect(address, authkey, timeout_s, name)
        self._lock = threading.Lock()

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            try:
                send_json(self._conn, {"method": method, "args": list(args), "kwargs": kwargs})
                reply = recv_json(self._conn, timeout, f"{self.name}.{method}()")
            except (OSError, EOFError) as error:
                raise NodeFailedError(f"{self.name}: call {method}() failed: connection lost ({error})") from None
        if not reply.get("ok"):
            raise NodeFailedError(f"{self.name}: {method}() raised {reply.get('error')}")
        return reply.get("result")

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass


def serve(conn: Connection, handler: Callable[[str, list[Any], dict[str, Any]], Any]) -> None:
    """Answer requests on one connection until the peer goes away; errors go back as replies."""
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            reply = {
                "ok": True,
                "result": handler(request["method"], request.get("args", []), request.get("kwargs", {})),
            }
        except BaseException as error:
            reply = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        try:
            send_json(conn, reply)
        except (OSError, ValueError, TypeError) as error:
            try:
                send_json(conn, {"ok": False, "error": f"reply not sendable: {error}"})
            except OSError:
                return


HANDSHAKE_TIMEOUT_S = 2.0
MAX_PENDING_HANDSHAKES = 64


class AuthListener:
    """Accepts TCP connections on `host` and hands each one, once it passed the HMAC handshake of
    `multiprocessing.connection` (the job token as key), to `on_connection(conn)`.

    The handshake runs in a thread of its own with a deadline (`handshake_timeout_s`), so a peer
    that connects and stalls, or sends garbage, costs one short-lived thread and never delays
    another client. At most `MAX_PENDING_HANDSHAKES` run at once; connections beyond are closed.
    `on_connection` runs in that thread and may keep it (to serve the connection)."""

    def __init__(
        self, host: str, authkey: bytes, on_connection: Callable[[Connection], None], name: str = "rpc",
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:  # fmt: skip
        self._authkey, self._on_connection, self._name = authkey, on_connection, name
        self.handshake_timeout_s = handshake_timeout_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, 0), family=family, backlog=128)
        bound_host, bound_port = self._sock.getsockname()[:2]
        self.address: Address = (str(bound_host), int(bound_port))
        self._closed = threading.Event()
        self._pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._sock.accept()
            except OSError:
                if self._closed.is_set():
                    return
                continue  # e.g. ECONNABORTED, EMFILE: the next accept may work
            if not self._pending.acquire(blocking=False):
                sock.close()
                continue
            threading.Thread(target=self._handshake, args=(sock,), name=f"{self._name}-conn", daemon=True).start()

    def _handshake(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        # The Connection gets its own descriptor; `sock` keeps one so that the deadline can shut the
        # socket down, which wakes the blocked read of the handshake (closing it would not).
        conn = Connection(os.dup(sock.fileno()))
        lock, state = threading.Lock(), {"done": False}

        def expire() -> None:
            with lock:
                if not state["done"]:
                    state["done"] = True  # a handshake that completes now is refused all the same
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        timer = threading.Timer(self.handshake_timeout_s, expire)
        timer.daemon = True
        timer.start()
        try:
            try:
                deliver_challenge(conn, self._authkey)
                answer_challenge(conn, self._authkey)
            except Exception:  # a wrong key, garbage, a stalled or vanished peer
                conn.close()
                return
            with lock:
                ok = not state["done"] and not self._closed.is_set()
                state["done"] = True
            if not ok:
                conn.close()
                return
        finally:
            timer.cancel()
            sock.close()
            self._pending.release()
        self._on_connection(conn)

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() on Linux
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=2.0)
