"""What both schedulers share: the master's heartbeat server that nodes report to, the per-job
token that authenticates every RPC, and the node logs in `<output_dir>/logs`."""

from __future__ import annotations

from pathlib import Path

from rlplex.control.backends.heartbeat import HeartbeatServer
from rlplex.control.backends.scheduler import NodeEvent, NodeHandle, read_log_tail
from rlplex.control.rpc import RpcClient, parse_address


class ServedScheduler:
    def __init__(
        self, output_dir: str | Path, job_id: str, token: bytes, rpc_timeout_s: float, host: str = "127.0.0.1"
    ) -> None:
        self.output_dir, self.job_id, self._token, self._rpc_timeout_s = Path(output_dir), job_id, token, rpc_timeout_s
        self.log_dir = self.output_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._server = HeartbeatServer(token, host)
        self.master_address = self._server.address
        self._handles: dict[str, NodeHandle] = {}

    def client(self, handle: NodeHandle, address: str) -> RpcClient:
        return RpcClient(parse_address(address), self._token, handle.node_id, self._rpc_timeout_s)

    def events(self) -> list[NodeEvent]:
        return self._server.events()

    def acknowledge(self, node_id: str, incarnation: int) -> bool:
        return self._server.acknowledge(node_id, incarnation)

    def log_tail(self, handle: NodeHandle, lines: int = 5) -> str:
        return read_log_tail(self.log_dir, handle.node_id, lines)
