"""The process kernel of the library's own children: one way to start, watch and stop them.

Sampler workers, copiers, runner ranks and model workers are started through `start_process`;
every blocking wait on a child has a timeout and a cause: `check_alive` turns a dead child
into `WorkerDiedError` naming it and its exit code, and `stop_processes` leaves no orphan
(terminate, then kill after a grace period). Every child is SIGTERMed at once when the process
that started it is killed (no orphan keeps training): `start_process` arranges it before the
target runs.

On Linux children come from a fork server (`forkserver`): one small server per launching
process imports torch and the first child's module once, then forks each child from that
single-threaded state, so a child starts in tenths of a second instead of seconds of imports and
shares those pages with its siblings. Not plain `fork`: forking a process that already runs torch
threads can deadlock. The server listens on a socket file in a private folder (mode 0600), so
only this user can ask it for a child. Elsewhere children are `spawn`ed.

Processes started as commands (vLLM servers, elastic scripts and node checks) call
`die_with_parent` for the same guarantee; control-plane nodes do not, since they outlive a
killed master by design. `PR_SET_PDEATHSIG` asks the kernel to signal the
child when its parent dies, however the parent dies (SIGKILL included). The request fires
when the *thread* that started the child exits, so children are started from a thread that
lives as long as the parent does (the main thread, in rlplex; the fork server's only thread,
which exits when its launcher does).

Jobs' nodes are not started here: the control plane's backends place, start and restart them
(`rlplex.control`).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any, cast

from rlplex.errors import WorkerDiedError

START_METHOD = "forkserver" if sys.platform == "linux" else "spawn"
CONTEXT = cast(ForkServerContext | SpawnContext, mp.get_context(START_METHOD))
# What the fork server imports before its first fork, beside the first child's own module (its
# guard first: it dies with its launcher).
PRELOAD = ["rlplex.fork_server_guard", "__main__", "torch"]
_PR_SET_PDEATHSIG = 1
# In a child of `start_process`: the pid of its OS parent when it started (the fork server or,
# with `spawn`, the launcher); another parent later means the child was orphaned.
_started_under: int | None = None


def die_with_parent(signum: int = signal.SIGTERM, parent_pid: int | None = None) -> None:
    """In the child: receive `signum` when the parent dies.

    With `parent_pid`, also close the race where the parent died before the request took
    effect (the child was then already re-parented, so the kernel will never signal it): the
    child exits at once with status 128 + `signum`, as if the signal had arrived. Does nothing
    off Linux.
    """
    if sys.platform != "linux":
        return
    with contextlib.suppress(Exception):  # no libc to load: the parent-pid check below still runs
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum))
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(128 + int(signum))


def _fork_server() -> Any:
    """multiprocessing's one fork server of this process: its pid and "alive" pipe are not public."""
    from multiprocessing import forkserver

    return forkserver._forkserver


def _server_pid(target: Callable[..., Any]) -> int:
    """The pid the next child's OS parent has: the fork server's (started now if it is not
    running, preloading `target`'s module) or, with `spawn`, this process's."""
    if START_METHOD != "forkserver":
        return os.getpid()
    server = _fork_server()
    with server._lock:
        if server._forkserver_pid is None:
            server.set_forkserver_preload([*PRELOAD, target.__module__])
    server.ensure_running()
    return int(server._forkserver_pid)


def _child_main(environ: dict[str, str], parent_pid: int, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    global _started_under
    # A forked child has the server's environment, from when it started; a spawned one had the
    # launcher's at the time of the start. Both now see the launcher's, as of `start_process`.
    os.environ.clear()
    os.environ.update(environ)
    if START_METHOD == "forkserver":
        # The server exits when every holder of its "alive" pipe has closed it; a child holds one
        # end from the fork. Closed here, the launcher's is the only one, so the launcher's death
        # ends the server, and that ends this child (below).
        server = _fork_server()
        if server._forkserver_alive_fd is not None:
            with contextlib.suppress(OSError):
                os.close(server._forkserver_alive_fd)
            server._forkserver_alive_fd = None
    # The OS parent: the fork server, which exits when its launcher does, or the launcher itself.
    die_with_parent(signal.SIGTERM, parent_pid)
    _started_under = parent_pid
    target(*args)


def orphaned() -> bool:
    """In a child of `start_process`: whether the process that started it is gone."""
    return _started_under is not None and os.getppid() != _started_under


def start_process(target: Callable[..., Any], args: tuple[Any, ...], name: str, daemon: bool = True) -> BaseProcess:
    """Start `target(*args)` in a child that dies with this process. `daemon=False` for a child
    that starts children of its own (a daemon may not)."""
    parent_pid = _server_pid(target)
    process = CONTEXT.Process(
        target=_child_main, args=(dict(os.environ), parent_pid, target, args), name=name, daemon=daemon
    )
    process.start()
    return process


def check_alive(processes: Sequence[BaseProcess]) -> None:
    for process in processes:
        if not process.is_alive():
            raise WorkerDiedError(f"{process.name} (pid {process.pid}) died with exit code {process.exitcode}")


def stop_processes(processes: Sequence[BaseProcess], grace_s: float = 3.0) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=grace_s)
        if process.is_alive():
            process.kill()
            process.join(timeout=grace_s)


@contextmanager
def handle_stop_signals(on_signal: Callable[[int], None]) -> Iterator[list[int]]:
    """SIGTERM and SIGINT call `on_signal(signum)` while the block runs (the main thread only:
    `signal.signal` works there alone), then the previous handlers are back. SIGINT is handled
    here too, not left to Python's default: a process that starts with SIGINT ignored (a
    script's `cmd &`, a test runner's worker) would otherwise ignore a Ctrl-C or `kill -INT` for
    good. Yields the signals received."""
    received: list[int] = []

    def handle(signum: int, frame: object) -> None:
        received.append(signum)
        on_signal(signum)

    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {signum: signal.signal(signum, handle) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class StopSignal(KeyboardInterrupt):
    """SIGTERM, SIGINT or SIGHUP, raised as Ctrl-C is: `signum` says which (the stop's cause)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum: int) -> None:
    raise StopSignal(signum)


def stop_signals_as_interrupt() -> AbstractContextManager[list[int]]:
    """SIGTERM stops a long command (`rlplex train`, `rlplex job run/resume`) like Ctrl-C: its
    cleanup runs (ranks, sampler processes or the job's nodes stopped) instead of the process
    vanishing."""
    return handle_stop_signals(_interrupt)
