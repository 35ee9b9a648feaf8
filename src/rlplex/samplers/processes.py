"""Child processes of the runners (sampler workers, copiers, ranks): start, watch, stop.

Every blocking wait on a child has a timeout and a cause: `check_alive` turns a dead child
into `WorkerDiedError` naming it and its exit code, and `stop_processes` leaves no orphan
(terminate, then kill after a grace period). A child calls `die_with_launcher` first thing,
so it is SIGTERMed at once when its parent is killed (no orphan keeps training).
"""

from __future__ import annotations

import multiprocessing as mp
import signal
from collections.abc import Callable, Sequence
from multiprocessing.context import SpawnProcess
from typing import Any

from rlplex.errors import WorkerDiedError
from rlplex.parent_death import die_with_parent

# `spawn`, not `fork`: forking a process that already runs torch threads can deadlock.
CONTEXT = mp.get_context("spawn")


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
