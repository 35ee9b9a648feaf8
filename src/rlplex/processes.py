"""The process kernel of the library's own children: one way to start, watch and stop them.

Sampler workers, copiers, runner ranks and model workers are `spawn`ed through `start_process`;
every blocking wait on a child has a timeout and a cause: `check_alive` turns a dead child
into `WorkerDiedError` naming it and its exit code, and `stop_processes` leaves no orphan
(terminate, then kill after a grace period). A child calls `die_with_launcher` first thing,
so it is SIGTERMed at once when its parent is killed (no orphan keeps training).

Processes started as commands (vLLM servers, elastic scripts and node checks) call
`die_with_parent` for the same guarantee; control-plane nodes do not, since they outlive a
killed master by design. `PR_SET_PDEATHSIG` asks the kernel to signal the
child when its parent dies, however the parent dies (SIGKILL included). The request fires
when the *thread* that started the child exits, so children are started from a thread that
lives as long as the parent does (the main thread, in rlplex).

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
from multiprocessing.context import SpawnProcess
from typing import Any

from rlplex.errors import WorkerDiedError

# `spawn`, not `fork`: forking a process that already runs torch threads can deadlock.
CONTEXT = mp.get_context("spawn")
_PR_SET_PDEATHSIG = 1


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


def die_with_launcher() -> None:
    """In a `spawn`ed child: SIGTERM when the process that started it dies; exit now if it has."""
    parent = mp.parent_process()
    die_with_parent(signal.SIGTERM, None if parent is None else parent.pid)


def start_process(target: Callable[..., Any], args: tuple[Any, ...], name: str, daemon: bool = True) -> SpawnProcess:
    """`daemon=False` for a child that starts children of its own (a daemon may not)."""
    process = CONTEXT.Process(target=target, args=args, name=name, daemon=daemon)
    process.start()
    return process


def check_alive(processes: Sequence[SpawnProcess]) -> None:
    for process in processes:
        if not process.is_alive():
            raise WorkerDiedError(f"{process.name} (pid {process.pid}) died with exit code {process.exitcode}")


def stop_processes(processes: Sequence[SpawnProcess], grace_s: float = 3.0) -> None:
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


def _interrupt(signum: int) -> None:
    raise KeyboardInterrupt


def stop_signals_as_interrupt() -> AbstractContextManager[list[int]]:
    """SIGTERM stops a long command (`rlplex train`, `rlplex job run/resume`) like Ctrl-C: its
    cleanup runs (ranks, sampler processes or the job's nodes stopped) instead of the process
    vanishing."""
    return handle_stop_signals(_interrupt)
