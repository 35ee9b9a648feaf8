"""The one RPC (`rlplex.control.rpc`) on its own: a real listener in this process, real sockets."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from rlplex.control.rpc import AuthListener, RpcClient, RpcConnectionLost, RpcRemoteError, serve
from rlplex.errors import NodeFailedError, WaitTimeoutError

KEY = b"k" * 32


class Handler:
    """Echoes, raises, or waits until released (a hung method)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __call__(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        if method == "echo":
            return {"args": args, "kwargs": kwargs}
        if method == "hang":
            self.release.wait(30)
            return "late"
        raise ValueError(f"no method {method!r}")


@pytest.fixture
def server() -> Iterator[tuple[AuthListener, Handler]]:
    handler = Handler()
    listener = AuthListener("127.0.0.1", KEY, lambda conn: serve(conn, handler), name="test-rpc")
    try:
        yield listener, handler
    finally:
        handler.release.set()
        listener.close()


def test_a_call_carries_bytes_and_arrays_and_a_remote_error_its_traceback(server: Any) -> None:
    listener, _ = server
    client = RpcClient(listener.address, KEY, "peer", timeout_s=5.0)
    try:
        array = np.arange(12, dtype=np.float32).reshape(3, 4)
        reply = client.call("echo", b"\x00\xff", array, flag=True)
        assert reply["args"][0] == b"\x00\xff"
        np.testing.assert_array_equal(reply["args"][1], array)
        assert reply["args"][1].dtype == np.float32 and reply["kwargs"] == {"flag": True}
        with pytest.raises(RpcRemoteError, match=r"peer\.nope\(\) raised ValueError: no method 'nope'") as caught:
            client.call("nope")
        assert "Traceback" in caught.value.remote_traceback and "raise ValueError" in caught.value.remote_traceback
    finally:
        client.close()


def test_a_hung_call_times_out_naming_the_peer_and_its_late_reply_is_skipped(server: Any) -> None:
    listener, handler = server
    client = RpcClient(listener.address, KEY, "model worker 'w'", timeout_s=5.0)
    try:
        start = time.monotonic()
        with pytest.raises(WaitTimeoutError, match=r"model worker 'w'\.hang\(\): no reply within 0\.3 s"):
            client.call("hang", timeout_s=0.3)
        assert time.monotonic() - start < 4.0
        handler.release.set()  # the late reply ("late") arrives before the next call's
        assert client.call("echo", 1) == {"args": [1], "kwargs": {}}
    finally:
        client.close()


def test_a_call_cut_off_by_ctrl_c_leaves_no_connection_to_hang_on(server: Any) -> None:
    """A call interrupted mid-exchange (Ctrl-C in the master) may leave the stream out of frame;
    the client drops the connection, so the next call (the master's stop of its nodes) fails at
    once instead of reading a body as a length and blocking for ever."""
    listener, handler = server
    client = RpcClient(listener.address, KEY, "node 'n'", timeout_s=30.0)

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            client.call("hang")
        handler.release.set()
        start = time.monotonic()
        with pytest.raises(RpcConnectionLost, match=r"node 'n'\.stop\(\): connection lost"):
            client.call("stop", timeout_s=1.0)
        assert time.monotonic() - start < 0.9  # within the call's own timeout: the drop was noticed, not waited out
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        client.close()


def test_a_connect_to_a_dead_address_fails_at_once_and_a_silent_one_within_its_timeout() -> None:
    with socket.socket() as probe:  # a port nobody listens on once this closes
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()
    start = time.monotonic()
    with pytest.raises(NodeFailedError, match=r"cannot connect to store 'x' at 127\.0\.0\.1:\d+: .*refused"):
        RpcClient(dead, KEY, "store 'x'", connect_timeout_s=1.0)
    assert time.monotonic() - start < 3.0
    silent = socket.create_server(("127.0.0.1", 0))  # accepts TCP, never answers the handshake
    try:
        start = time.monotonic()
        with pytest.raises(WaitTimeoutError, match=r"connecting to store 'x' at 127\.0\.0\.1:\d+ took over 0\.5 s"):
            RpcClient(silent.getsockname(), KEY, "store 'x'", connect_timeout_s=0.5)
        assert time.monotonic() - start < 2.0
    finally:
        silent.close()


def test_a_wrong_key_is_refused_and_a_closed_peer_reads_as_connection_lost(server: Any) -> None:
    listener, _ = server
    with pytest.raises(NodeFailedError, match=r"cannot connect to intruder .*(digest|Authentication)"):
        RpcClient(listener.address, b"wrong key", "intruder", timeout_s=2.0)
    client = RpcClient(listener.address, KEY, "peer", timeout_s=2.0)
    assert client.call("echo") == {"args": [], "kwargs": {}}  # the refusal cost the listener nothing
    client.close()
    # A peer that authenticates, then goes away without answering.
    closing = AuthListener("127.0.0.1", KEY, lambda conn: conn.close(), name="closing")
    try:
        client = RpcClient(closing.address, KEY, "peer", timeout_s=2.0)
        with pytest.raises(RpcConnectionLost, match=r"peer\.echo\(\): connection lost"):
            client.call("echo")
        client.close()
    finally:
        closing.close()
