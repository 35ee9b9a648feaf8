"""Trainer-driven pattern: a driver calls a method on the nodes of a role and gets futures.

    group = context.role_group("actor")
    group.call("load", path)            # every rank -> list of futures
    group.call_rank(0, "save")          # one rank -> one future
    group.scatter("train", batches)     # item i to rank i % size -> list of futures

Calls go over the same authenticated RPC as the master's (`rlplex.control.rpc`: JSON-like arguments
and results, bytes and arrays too).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlplex.control.job.states import NodeState
from rlplex.control.job.store import JobStore
from rlplex.control.rpc import RpcClient, parse_address

if TYPE_CHECKING:
    from rlplex.control.node.worker import WorkerContext


class RoleGroup:
    def __init__(self, role: str, clients: list[RpcClient]) -> None:
        self.role, self._clients = role, clients
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(clients)), thread_name_prefix=f"group-{role}")

    @classmethod
    def connect(cls, context: WorkerContext, role: str, timeout_s: float = 10.0) -> RoleGroup:
        """Wait until every node of `role` runs, then connect to each (in rank order)."""
        return cls.of_job(context.output_dir, context.job_id, context.token, role, timeout_s)

    @classmethod
    def of_job(cls, output_dir: Path, job_id: str, token: bytes, role: str, timeout_s: float = 10.0) -> RoleGroup:
        """`connect` for a caller outside the job's nodes that holds its token (the master's process)."""
        with JobStore.open_readonly(output_dir, job_id) as job:
            nodes = job.wait_nodes(role, lambda n: n.state == NodeState.RUNNING and bool(n.address), timeout_s)
        return cls(role, [RpcClient(parse_address(n.address), token, n.node_id) for n in nodes])

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
