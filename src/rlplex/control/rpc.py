"""Control RPC between our processes: JSON over HMAC-authenticated `multiprocessing.connection`.

Payloads are JSON (never pickle), sent with `send_bytes`. Every wait has a timeout; connecting
runs in a helper thread because the HMAC handshake of `Client` has no timeout of its own and a
stopped peer (SIGSTOP) would otherwise block the master forever.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from multiprocessing.connection import Client, Connection
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
