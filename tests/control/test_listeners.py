"""The control plane's listeners against clients that connect and then stall or send garbage:
the HMAC handshake runs off the accepting thread with a deadline, so nobody else waits."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from node_helpers import wait_for
from rlplex.control import JobBuilder, JobState, NodeState, PrimeMaster
from rlplex.control.job.master import read_token
from rlplex.control.rpc import RpcClient, connect, parse_address

pytestmark = pytest.mark.e2e


@contextlib.contextmanager
def bad_clients(addresses: list[str], per_address: int = 3) -> Iterator[None]:
    """Idle connections (connect, send nothing) and garbage ones, held open for the block."""
    socks = []
    try:
        for address in addresses:
            for i in range(per_address):
                idle = socket.create_connection(parse_address(address), timeout=5.0)
                garbage = socket.create_connection(parse_address(address), timeout=5.0)
                garbage.sendall(b"GET / HTTP/1.1\r\n\r\n" if i % 2 else b"\x00\x00\x00\x10not a handshake")
                socks += [idle, garbage]
        yield
    finally:
        for sock in socks:
            sock.close()


T = TypeVar("T")


def within(limit_s: float, what: str, action: Callable[[], T]) -> T:
    start = time.monotonic()
    result = action()
    took = time.monotonic() - start
    assert took < limit_s, f"{what} took {took:.2f} s with idle clients connected (limit {limit_s} s)"
    return result


def test_idle_and_garbage_clients_do_not_lock_the_control_plane_out(job_dir: Path) -> None:
    spec = (
        JobBuilder("listeners", job_dir, capacity={"cpu": 2}, heartbeat_interval_s=0.1, stop_grace_s=2.0)
        .role("idle", entrypoint="control_workers:Idle", count=1, resources={"cpu": 0.5})
        .build()
    )
    with PrimeMaster.create(spec) as master:
        master.start()
        token = read_token(job_dir)
        (node,) = master.get_nodes_by_role()["idle"]
        master_address = master.manager.scheduler.master_address
        with bad_clients([master_address, node.address]):
            # A node's control RPC: a new client connects and gets status() at once.
            address = parse_address(node.address)
            client = within(1.0, "connecting to a node", lambda: RpcClient(address, token, node.node_id, 1.0))
            assert within(1.0, "status()", lambda: client.call("status")) == "RUNNING"
            client.close()
            # The master's listener: a new peer is authenticated at once, and the monitor goes on.
            peer = within(
                1.0, "the master's handshake", lambda: connect(parse_address(master_address), token, 1.0, "x")
            )
            peer.close()
            assert within(1.0, "monitor()", master.monitor) == JobState.RUNNING
            # A new node says hello through the same listener and is checked and started.
            master.scale_role("idle", 2)

            def both_running() -> bool:
                master.monitor()
                return [n.state for n in master.get_nodes_by_role()["idle"]] == [NodeState.RUNNING] * 2

            wait_for(both_running, 20, "the scaled-up node to say hello and run")
            within(5.0, "stop()", master.stop)
        assert master.state == JobState.STOPPED
