"""The node runtime, and the node process `python -m rlplex.control.node.runtime --output-dir D --job-id J
--node-id N --incarnation I`.

`NodeRuntime` is the same in an OS process (local backend, `main()` below) and inside a Ray
actor (`rlplex.control.backends.ray`): it reads its role from the job's store, builds the
entry point's worker, serves the control RPC on `host` (127.0.0.1 unless a multi-machine Ray
cluster needs the node's IP; authkey = the job token, read from the job folder; see
`rlplex.control.job.token` for when the entry point sees it) and pushes heartbeats with the
worker's status and progress to the master's listener. When the master goes away the node
keeps working and reconnects to whatever address the store names next (a resumed master); it
delivers its final message (FINISHED, FAILED, STOPPED) and exits once a master acknowledges it
(the master stores it first), telling every new master again until one does; it stops itself
if no master shows up within `master_lost_timeout_s`. A node whose incarnation the store has
moved past (a resumed master relaunched it) is stale and stops itself.

Messages to the master: hello {pid, address}, heartbeat {status, progress, error}, final.
From the master: ack (of the final message).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from rlplex.control.job.states import NodeState
from rlplex.control.job.store import JobStore
from rlplex.control.job.token import expose_token, read_token
from rlplex.control.node.worker import SubMaster, Worker, WorkerContext, load_entrypoint
from rlplex.control.rpc import AuthListener, connect, format_address, parse_address, recv_message, send_message, serve
from rlplex.errors import NodeFailedError, WaitTimeoutError

JOB_DIR_ENV = "RLPLEX_JOB_DIR"


class NodeRuntime:
    def __init__(
        self, output_dir: str | Path, job_id: str, node_id: str, incarnation: int, token: bytes, host: str = "127.0.0.1"
    ) -> None:
        self.output_dir = Path(output_dir)
        self.job_id, self.node_id, self.incarnation = job_id, node_id, incarnation
        self.token, self.host = token, host
        self.job = JobStore.open_readonly(self.output_dir, job_id)
        self.spec: dict[str, Any] = self.job.spec()
        record = self.job.node(self.node_id)
        if record is None:
            raise RuntimeError(f"{self.output_dir}: job {job_id} has no node {node_id}")
        self.role, self.rank = record.role, record.rank
        self.role_spec: dict[str, Any] = self.spec["roles"][self.role]
        # Before any user code runs in this process: it (and what it starts) sees the token only on request.
        expose_token(self.token, bool(self.role_spec.get("needs_job_token", False)))
        # Not a secret: lets a role's scripts (and tests) find the job they belong to.
        os.environ[JOB_DIR_ENV] = str(self.output_dir.resolve())
        self.interval = float(self.spec["heartbeat_interval_s"])
        self.stop_requested = threading.Event()
        self.superseded = False
        self.worker: Worker | None = None
        # One thread per authenticated connection serves the control RPC (see AuthListener).
        self.listener = AuthListener(host, self.token, lambda conn: serve(conn, self.handle), name="node-rpc")
        self.master: Connection | None = None

    def build_worker(self) -> Worker:
        world: dict[str, int] = {}
        for node in self.job.nodes():
            if node.state != NodeState.STOPPED:
                world[node.role] = world.get(node.role, 0) + 1
        context = WorkerContext(
            job_id=self.job_id,
            role=self.role,
            rank=self.rank,
            node_id=self.node_id,
            world=world,
            config=dict(self.role_spec.get("config", {})),
            output_dir=self.output_dir,
            incarnation=self.incarnation,
            token=self.token,
            host=self.host,
            backend=str(self.spec["backend"]),
        )
        return load_entrypoint(self.role_spec["entrypoint"], self.role_spec["kind"])(context)

    def handle(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        worker = self.worker
        if worker is None:
            raise RuntimeError(f"{self.node_id}: worker not built yet")
        if method == "status":
            return worker.status()
        if method in ("self_check", "start"):
            return getattr(worker, method)()
        if method == "check_child":
            if not isinstance(worker, SubMaster):
                raise TypeError(f"{self.node_id} is not a SubMaster")
            return worker.check_child()
        if method == "stop":
            self.stop_requested.set()
            return None
        if method == "call":
            name, *rest = args
            if name.startswith("_") or not callable(getattr(worker, name, None)):
                raise AttributeError(f"{type(worker).__name__} has no public method '{name}'")
            return getattr(worker, name)(*rest, **kwargs)
        raise AttributeError(f"unknown control method '{method}'")

    def _check_superseded(self) -> bool:
        """True (and stop) when the store names a newer incarnation of this node: this process is stale."""
        record = self.job.node(self.node_id)
        current = record.incarnation if record is not None else None
        if current is not None and current > self.incarnation and not self.superseded:
            print(f"{self.node_id}: incarnation {current} replaces this one ({self.incarnation}); stopping",
                  file=sys.stderr, flush=True)  # fmt: skip
            self.superseded = True
            self.stop_requested.set()
        return self.superseded

    def send(self, message: dict[str, Any]) -> bool:
        """Send to the master, (re)connecting first; False when no master can be reached now."""
        if self.master is None:
            try:
                if self._check_superseded():
                    return False
                address = self.job.job().master_address
                if not address:
                    return False
                self.master = connect(parse_address(address), self.token, max(self.interval, 1.0), "master")
                send_message(
                    self.master,
                    {
                        "type": "hello",
                        "node_id": self.node_id,
                        "incarnation": self.incarnation,
                        "pid": os.getpid(),
                        "address": format_address(self.listener.address),
                    },
                )
            except Exception:
                self.master = None
                return False
        try:
            send_message(self.master, {"node_id": self.node_id, "incarnation": self.incarnation, **message})
            return True
        except OSError:
            self.master = None
            return False

    def run(self) -> int:
        if self._check_superseded():
            return 5
        try:
            self.worker = self.build_worker()
        except BaseException as error:
            traceback.print_exc()
            return self.finish({"type": "final", "status": NodeState.FAILED, "error": f"__init__ failed: {error!r}"}, 3)
        worker = self.worker
        lost_since: float | None = None
        lost_timeout = float(self.spec["master_lost_timeout_s"])
        while True:
            status = worker.status()
            message = {"type": "heartbeat", "status": status, "progress": worker.context.progress()}
            if self.stop_requested.is_set():
                worker.stop()
                return self.finish({**message, "type": "final", "status": NodeState.STOPPED}, 0)
            if status in (NodeState.FINISHED, NodeState.FAILED):
                code = 0 if status == NodeState.FINISHED else 1
                return self.finish({**message, "type": "final", "error": worker.error}, code)
            if self.send(message):
                lost_since = None
            else:
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > lost_timeout:
                    print(f"{self.node_id}: no master for {lost_timeout:g} s; stopping", file=sys.stderr)
                    worker.stop()
                    return 4
            self.stop_requested.wait(self.interval)

    def finish(self, message: dict[str, Any], code: int) -> int:
        """Deliver the final message until a master acknowledges it (it has stored it then).

        A master that goes away unacknowledged gets it from the node again once resumed; only
        `master_lost_timeout_s` without any master reachable (or a silent one) ends the wait."""
        lost_timeout = float(self.spec["master_lost_timeout_s"])
        deadline = time.monotonic() + lost_timeout
        while time.monotonic() < deadline and not self.superseded:
            if not self.send(message):
                time.sleep(self.interval)
                continue
            deadline = time.monotonic() + lost_timeout
            if self._acknowledged(deadline):
                return code
        return code

    def _acknowledged(self, deadline: float) -> bool:
        """Wait for the master's ack on the open connection; False when it closes or the deadline passes."""
        conn = self.master
        while conn is not None and time.monotonic() < deadline:
            try:
                message = recv_message(conn, self.interval, "master")
            except WaitTimeoutError:
                continue
            except NodeFailedError:  # gone, or not our protocol
                break
            if isinstance(message, dict) and message.get("type") == "ack":
                conn.close()
                self.master = None
                return True
        if conn is not None:
            conn.close()
        self.master = None
        return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rlplex.control.node.runtime")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--incarnation", type=int, default=0)
    args = parser.parse_args(argv)
    token = read_token(args.output_dir)
    runtime = NodeRuntime(args.output_dir, args.job_id, args.node_id, args.incarnation, token)
    signal.signal(signal.SIGTERM, lambda *_: runtime.stop_requested.set())
    code = runtime.run()
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: user threads (non-daemon loops) must not keep a stopped node alive.
    os._exit(code)


if __name__ == "__main__":
    main()
