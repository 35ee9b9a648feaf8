"""The local backend: every node is an OS process on this machine.

Each node is what `python -m rlplex.control.node.runtime` would be, forked by the master's fork
server (`rlplex.control.forker`: it imports the runtime and the job's `preload` once) into its own
session (process group), so that killing the master leaves the nodes running for a resumed
master, and killing a node kills everything it started. Output goes to
`<output_dir>/logs/<node_id>.log`. The fork server reports each node's exit code; nodes started
by a previous master are watched through psutil (pid plus creation time, so a reused pid is
never mistaken for our node).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import psutil

from rlplex.control.backends.scheduler import NodeHandle
from rlplex.control.backends.served import ServedScheduler
from rlplex.control.forker import ForkRequest, ForkServer
from rlplex.control.job.placement import Bundle
from rlplex.control.job.token import TOKEN_ENV
from rlplex.control.node.runtime import JOB_DIR_ENV
from rlplex.io.shm_reaper import group_pids, release, shm_in_use

# What every node runs (always preloaded).
NODE_MODULE = "rlplex.control.node.runtime"


def _child_pythonpath() -> str:
    """rlplex's own source first (a worktree must beat an installed copy), then the master's sys.path."""
    import rlplex

    entries = [str(Path(rlplex.__file__).resolve().parents[1]), *(p for p in sys.path if p)]
    return os.pathsep.join(dict.fromkeys(entries))


class LocalScheduler(ServedScheduler):
    def __init__(
        self,
        output_dir: str | Path,
        job_id: str,
        token: bytes,
        rpc_timeout_s: float = 10.0,
        preload: Sequence[str] = (),
    ) -> None:
        super().__init__(output_dir, job_id, token, rpc_timeout_s)
        self._preload = list(preload)
        self._forker: ForkServer | None = None
        # No token here: a node reads it from the job folder (an environment is readable in /proc and
        # inherited by every child); a master that itself runs with the token does not pass it on.
        self._env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        self._env.update(PYTHONPATH=_child_pythonpath(), **{JOB_DIR_ENV: str(Path(output_dir).resolve())})

    def _fork_server(self) -> ForkServer:
        """The node fork server, started at the first launch (and again if it has gone)."""
        if self._forker is None or not self._forker.running:
            if self._forker is not None:
                self._forker.close()
            self._forker = ForkServer([NODE_MODULE, *self._preload], self._env)
        return self._forker

    def _launch(self, node_id: str, role: str, rank: int, incarnation: int, bundle: int) -> NodeHandle:
        argv = ["--output-dir", str(self.output_dir), "--job-id", self.job_id, "--node-id", node_id]
        argv += ["--incarnation", str(incarnation)]
        log = self.log_dir / f"{node_id}.log"
        with open(log, "ab") as file:
            file.write(f"--- {node_id} incarnation {incarnation}\n".encode())
        forker = self._fork_server()
        request = ForkRequest(
            call=f"{NODE_MODULE}:main", argv=argv, env=self._env, cwd=os.getcwd(), log=str(log), new_session=True
        )
        pid = forker.launch(request).pid
        try:
            create_time = psutil.Process(pid).create_time()
        except psutil.Error:
            create_time = 0.0
        handle = NodeHandle(node_id, role, rank, incarnation, pid, create_time, bundle, forker)
        self._handles[node_id] = handle
        return handle

    def create_nodes(self, bundles: list[Bundle], incarnations: dict[str, int]) -> list[NodeHandle]:
        return [
            self._launch(m.node_id, m.role, m.rank, incarnations.get(m.node_id, 0), bundle.index)
            for bundle in bundles
            for m in bundle.members
        ]

    def restart(self, handle: NodeHandle, incarnation: int) -> NodeHandle:
        self.kill(handle)
        return self._launch(handle.node_id, handle.role, handle.rank, incarnation, handle.bundle)

    def attach(self, node_id: str, role: str, rank: int, incarnation: int, pid: int, create_time: float) -> NodeHandle:
        handle = NodeHandle(node_id, role, rank, incarnation, pid, create_time)
        self._handles[node_id] = handle
        return handle

    def _process(self, handle: NodeHandle) -> psutil.Process | None:
        try:
            process = psutil.Process(handle.pid)
            if handle.create_time and abs(process.create_time() - handle.create_time) > 0.01:
                return None  # the pid was reused by someone else
            return process
        except psutil.Error:
            return None

    def is_alive(self, handle: NodeHandle) -> bool:
        if isinstance(handle.ref, ForkServer) and handle.ref.exit_code(handle.pid) is not None:
            return False
        process = self._process(handle)
        try:
            return process is not None and process.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def exit_code(self, handle: NodeHandle) -> int | None:
        # A node that has just died may not be reaped and reported yet: a moment's wait.
        return handle.ref.exit_code(handle.pid, timeout_s=1.0) if isinstance(handle.ref, ForkServer) else None

    def kill(self, handle: NodeHandle) -> None:
        if handle.pid <= 0:
            return
        shm: set[str] = set()
        if self._process(handle) is not None:
            # The SIGKILL below takes the group's resource tracker with it: note what shared memory
            # the group holds, to unlink what its processes leave (see rlplex.io.shm_reaper).
            shm = shm_in_use(group_pids(handle.pid))
            try:
                os.killpg(handle.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if isinstance(handle.ref, ForkServer) and handle.ref.running:
            handle.ref.exit_code(handle.pid, timeout_s=5.0)  # the server reaps it
        else:
            process = self._process(handle)
            if process is not None:
                psutil.wait_procs([process], timeout=5.0)
        release(shm)

    def _close_fork_server(self) -> None:
        if self._forker is not None:
            self._forker.close()
            self._forker = None

    def cleanup(self) -> None:
        for handle in self._handles.values():
            self.kill(handle)
        self._handles.clear()
        self._close_fork_server()
        self._server.close()

    def detach(self) -> None:
        """Forget the nodes without killing them (tests simulate a master that dies)."""
        self._handles.clear()
        self._close_fork_server()
        self._server.close()
