"""Trainer-driven pattern: a driver calls a method on the nodes of a role and gets futures.

    group = context.role_group("actor")
    group.call("load", path)            # every rank -> list of futures
    group.call_rank(0, "save")          # one rank -> one future
    group.scatter("train", batches)     # item i to rank i % size -> list of futures

Calls go over the same authenticated RPC as the master's (`rlplex.control.rpc`: JSON-like arguments
and results, bytes and arrays too).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from rlplex.control.rpc import RpcClient, parse_address
from rlplex.control.store import SqliteStateStore
from rlplex.errors import WaitTimeoutError

if TYPE_CHECKING:
    from rlplex.control.worker import WorkerContext


class RoleGroup:
    def __init__(self, role: str, clients: list[RpcClient]) -> None:
        self.role, self._clients = role, clients
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(clients)), thread_name_prefix=f"group-{role}")

    @classmethod
    def connect(cls, context: WorkerContext, role: str, timeout_s: float = 10.0) -> RoleGroup:
        """Wait until every node of `role` runs, then connect to each (in rank order)."""
        store = SqliteStateStore.in_dir(context.output_dir, create=False)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                nodes = [n for n in store.nodes(context.job_id) if n.role == role and n.state != "STOPPED"]
                if nodes and all(n.state == "RUNNING" and n.address for n in nodes):
                    break
                if time.monotonic() > deadline:
                    shown = {n.node_id: n.state for n in nodes}
                    raise WaitTimeoutError(f"role group '{role}': not every node RUNNING within {timeout_s} s: {shown}")
                time.sleep(0.05)
        finally:
            store.close()
        nodes.sort(key=lambda n: n.rank)
        return cls(role, [RpcClient(parse_address(n.address), context.token, n.node_id) for n in nodes])

    @property
    def size(self) -> int:
        return len(self._clients)

    def call_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Future[Any]:
        return self._pool.submit(self._clients[rank].call, "call", method, *args, **kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Future[Any]]:
        return [self.call_rank(rank, method, *args, **kwargs) for rank in range(self.size)]

    def scatter(self, method: str, items: Sequence[Any]) -> list[Future[Any]]:
        return [self.call_rank(i % self.size, method, item) for i, item in enumerate(items)]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for client in self._clients:
            client.close()
