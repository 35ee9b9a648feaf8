"""The node actor of the Ray backend: a `NodeRuntime` hosted in a Ray actor.

Kept apart from the scheduler so that an actor's process imports only what a node needs
(no pydantic): every node actor is a fresh Python process, and its start-up is on the
critical path of job start and of every restart.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray

# A finished actor waits this long for the master to collect and kill it, then exits on its own
# (a detached actor whose master is gone for good must not hold its resources forever).
_LINGER_S = 10.0


def node_host(scheduler_host: str) -> str:
    """The address this node serves on and gives its peers (control RPC, an elastic rank 0's store).

    127.0.0.1 when the whole cluster is one machine (the scheduler's host says so); otherwise this
    machine's IP as Ray knows it, asked on the node itself: nodes of one job run on many machines."""
    return scheduler_host if scheduler_host == "127.0.0.1" else ray.util.get_node_ip_address()


class NodeActor:
    """One node inside Ray: the `NodeRuntime` in a thread; its stdout and stderr go to the node's log file."""

    def __init__(
        self, output_dir: str, job_id: str, node_id: str, incarnation: int, host: str, env: dict[str, str]
    ) -> None:
        from rlplex.control.job.token import read_token
        from rlplex.control.node.runtime import NodeRuntime

        os.environ.update(env)
        log_dir = Path(output_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log = os.open(log_dir / f"{node_id}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(
            log,
            f"--- {node_id} incarnation {incarnation} (ray actor, pid {os.getpid()}) at {time.time():.3f}\n".encode(),
        )
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        host = node_host(host)
        # The token from the job folder (shared by every machine of the cluster), never an actor
        # argument: Ray keeps those in its task specs, which its state API and dashboard show.
        token = read_token(output_dir)
        self._runtime = NodeRuntime(output_dir, job_id, node_id, incarnation, token, host)
        self._done = threading.Event()
        self._code = -1
        threading.Thread(target=self._main, name="node-runtime", daemon=True).start()

    def _main(self) -> None:
        try:
            self._code = self._runtime.run()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            self._done.set()
        time.sleep(_LINGER_S)
        os._exit(self._code)

    def wait_exit(self) -> int:
        self._done.wait()
        return self._code

    def pid(self) -> int:
        return os.getpid()


RemoteNode: Any = ray.remote(NodeActor)
