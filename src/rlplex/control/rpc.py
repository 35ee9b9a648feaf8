"""Our one RPC between processes: msgpack over HMAC-authenticated `multiprocessing.connection`.

It carries the control plane (master <-> node calls, heartbeats) and the dataflow (master <->
model worker calls, peer-to-peer tensor fetches) alike:

    RpcClient(address, key, name).call(method, *args, timeout_s=...)  --request {id, method, args, kwargs}-->
    AuthListener(host, key, lambda conn: serve(conn, handler))         <--reply {id, ok, result | error}--

- Authenticated: the HMAC challenge of `multiprocessing.connection` with a shared key (a job's
  token, an executor's random key), both ways, before any message is read.
- Every wait has a timeout. Connecting runs in a helper thread because the handshake of
  `Client` has no timeout of its own and a stopped peer (SIGSTOP) would otherwise block the
  caller forever; a call waits `timeout_s` for its reply. For the same reason the serving side
  is `AuthListener`, not `multiprocessing.connection.Listener`: the listener's `accept()` runs
  the handshake on the accepting thread, so one client that connects and sends nothing would
  lock every other client out.
- Request ids: a reply answers the request with its id; one that arrives after its call timed
  out is skipped by the next call, so a connection never gets out of step.
- Payloads: JSON-like values plus bytes, numpy arrays and torch tensors (their raw bytes laid
  after a msgpack header: the codec of `rlplex.control.channels.base`), never pickle. Dict keys are
  str; tuples arrive as lists.
"""

from __future__ import annotations

import itertools
import math
import os
import select
import socket
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from typing import Any

from rlplex.control.channels.base import decode_item, encode_item
from rlplex.errors import NodeFailedError, WaitTimeoutError

Address = tuple[str, int]
Handler = Callable[[str, list[Any], dict[str, Any]], Any]


class RpcConnectionLost(NodeFailedError):
    """The peer closed the connection or died; nothing more can be sent or read on it."""


class RpcRemoteError(NodeFailedError):
    """The called method raised on the serving side; `remote_traceback` is the peer's traceback."""

    def __init__(self, message: str, remote_traceback: str) -> None:
        super().__init__(message)
        self.remote_traceback = remote_traceback


def send_message(conn: Connection, message: Any) -> None:
    encoded = encode_item(message)
    buffer = bytearray(encoded.size)
    encoded.write(memoryview(buffer))
    conn.send_bytes(buffer)


def recv_message(conn: Connection, timeout_s: float | None, what: str) -> Any:
    """The next message; `timeout_s=None` when the caller knows one is ready (a selector said so)."""
    try:
        if timeout_s is not None:
            # select.poll, not conn.poll: that builds a selector per call, 7x the cost of this
            poller = select.poll()
            poller.register(conn.fileno(), select.POLLIN)
            if not poller.poll(math.ceil(timeout_s * 1000)):
                raise WaitTimeoutError(f"no message from {what} within {timeout_s:g} s")
        data = conn.recv_bytes()
    except (EOFError, OSError) as error:
        raise RpcConnectionLost(f"{what}: connection lost ({error!r})") from None
    try:
        return decode_item(memoryview(data))
    except Exception as error:  # framing is intact (a whole message was read): the connection is usable
        raise NodeFailedError(f"{what}: undecodable message of {len(data)} bytes ({error})") from None


def parse_address(text: str) -> Address:
    host, _, port = text.rpartition(":")
    return host, int(port)


def format_address(address: Any) -> str:
    host, port = address
    return f"{host}:{port}"


def connect(address: Address, authkey: bytes, timeout_s: float, what: str) -> Connection:
    """An authenticated connection to `address`, or `WaitTimeoutError` / `NodeFailedError` naming `what`."""
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
        raise NodeFailedError(f"cannot connect to {what} at {format_address(address)}: {result['error']!r}")
    conn: Connection = result["conn"]
    return conn


class RpcClient:
    """Calls `method(*args, **kwargs)` on a peer; thread-safe (one call at a time per connection).

    Connects at construction (within `connect_timeout_s`, by default `timeout_s`). A call raises
    `WaitTimeoutError` past its timeout, `RpcConnectionLost` when the peer is gone (the client
    is unusable then) and `RpcRemoteError` when the method raised; each message names the peer."""

    def __init__(
        self, address: Address, authkey: bytes, name: str, timeout_s: float = 10.0,
        connect_timeout_s: float | None = None,
    ) -> None:  # fmt: skip
        self.name, self.address, self.timeout_s = name, address, timeout_s
        self._conn = connect(address, authkey, timeout_s if connect_timeout_s is None else connect_timeout_s, name)
        self._lock = threading.Lock()
        self._ids = itertools.count()

    def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        what = f"{self.name}.{method}()"
        with self._lock:
            try:
                reply = self._exchange(method, args, kwargs, timeout, what)
            except (WaitTimeoutError, NodeFailedError):
                raise  # whole messages only were read or written: the connection stays in step
            except BaseException:
                # Cut off mid-message (Ctrl-C's KeyboardInterrupt, say): the stream is out of
                # frame, and a later call would read a body as a length and block for ever.
                self.close()
                raise
        if not reply.get("ok"):
            raise RpcRemoteError(f"{what} raised {reply.get('error')}", str(reply.get("traceback", "")))
        return reply.get("result")

    def _exchange(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float, what: str) -> Any:
        request_id = next(self._ids)
        try:
            send_message(self._conn, {"id": request_id, "method": method, "args": list(args), "kwargs": kwargs})
        except (OSError, ValueError) as error:  # ValueError: the connection was closed here
            raise RpcConnectionLost(f"{what}: connection lost ({error!r})") from None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                reply = recv_message(self._conn, max(left, 0.0), what)
            except WaitTimeoutError:
                raise WaitTimeoutError(f"{what}: no reply within {timeout:g} s") from None
            if not isinstance(reply, dict):
                raise NodeFailedError(f"{what}: reply is not a message: {reply!r:.200}")
            if reply.get("id") == request_id:
                return reply
            if not (isinstance(reply.get("id"), int) and reply["id"] < request_id):
                raise NodeFailedError(f"{what}: reply to request {reply.get('id')!r}, not {request_id}")
            # else: the late reply of a call that timed out

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass


def serve(conn: Connection, handler: Handler) -> None:
    """Answer requests on one connection until the peer goes away; errors go back as replies."""
    with conn:
        while True:
            try:
                request = recv_message(conn, None, "rpc client")
            except RpcConnectionLost:
                return
            except NodeFailedError:
                continue  # an undecodable request of an authenticated peer: nothing to answer
            request_id = request.get("id") if isinstance(request, dict) else None
            try:
                result = handler(str(request["method"]), list(request.get("args", [])), dict(request.get("kwargs", {})))
                reply = {"id": request_id, "ok": True, "result": result}
            except BaseException as error:
                reply = {
                    "id": request_id, "ok": False, "error": f"{type(error).__name__}: {error}",
                    "traceback": "".join(traceback.format_exception(error)),
                }  # fmt: skip
            try:
                send_message(conn, reply)
            except Exception as error:  # a result the codec cannot carry; a peer gone (OSError)
                try:
                    send_message(conn, {"id": request_id, "ok": False, "error": f"reply not sendable: {error}"})
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
