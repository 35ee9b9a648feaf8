"""A child process that must not outlive the process that started it (Linux).

One helper for every such child rlplex starts (runner ranks, sampler and copier processes,
vLLM servers, elastic scripts). `PR_SET_PDEATHSIG` asks the kernel to signal the child when
its parent dies, however the parent dies (SIGKILL included). The request fires when the
*thread* that started the child exits, so children should be started from a thread that
lives as long as the parent does (the main thread, in rlplex).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

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
