"""Cross-process waiting and liveness for shared-memory structures (Linux).

`FUTEX` sleeps on a u32 word in a shared mapping until a peer changes it and wakes the
sleepers; `pid_alive` tells a waiter whether the peer holding what it waits on is gone;
`acquire_polling` takes a multiprocessing lock without hanging behind a dead holder.
Together they let a process of one machine wait for another without a broker or a pipe.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_POLL_S = 0.2  # how often a polling acquire re-checks its peer

__all__ = ["FUTEX", "Futex", "acquire_polling", "pid_alive"]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
    """Linux futex wait/wake on a u32 in a shared mapping; a short sleep where futexes are missing."""

    _WAIT, _WAKE = 0, 1  # FUTEX_WAIT, FUTEX_WAKE, not the _PRIVATE variants: the word is shared across processes

    def __init__(self) -> None:
        numbers = {"x86_64": 202, "aarch64": 98}
        machine = os.uname().machine
        self._number = numbers.get(machine, 0) if sys.platform == "linux" else 0
        self._syscall: Any = None
        if self._number:
            libc = ctypes.CDLL(None, use_errno=True)
            self._syscall = libc.syscall
            self._syscall.restype = ctypes.c_long

    def word(self, mm: mmap.mmap, offset: int) -> Any:
        """A ctypes view of the u32 at `offset`; it pins `mm` open until deleted."""
        return ctypes.c_uint32.from_buffer(mm, offset)

    def wait(self, word: Any, expected: int, timeout_s: float) -> None:
        """Return when `word` may differ from `expected`, or after `timeout_s` (spurious wakeups allowed)."""
        if self._syscall is None:
            time.sleep(min(timeout_s, 0.001))
            return
        seconds = int(max(timeout_s, 0.0))
        spec = _Timespec(seconds, int((max(timeout_s, 0.0) - seconds) * 1e9))
        # Returns EAGAIN at once if the word already changed: no wakeup is lost between unlock and sleep.
        self._syscall(
            ctypes.c_long(self._number),
            ctypes.c_void_p(ctypes.addressof(word)),
            ctypes.c_int(self._WAIT),
            ctypes.c_uint32(expected),
            ctypes.byref(spec),
            None,
            ctypes.c_int(0),
        )

    def wake(self, word: Any) -> None:
        """Wake every process sleeping on `word`."""
        if self._syscall is not None:
            args = (ctypes.c_void_p(ctypes.addressof(word)), ctypes.c_int(self._WAKE), ctypes.c_int(2**31 - 1))
            self._syscall(ctypes.c_long(self._number), *args, None, None, ctypes.c_int(0))


FUTEX = Futex()


def pid_alive(pid: int) -> bool:
    """False once `pid` has exited (a zombie counts as exited: it will never touch shared memory again)."""
    if pid == os.getpid():
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] not in (b"Z", b"X")


def acquire_polling(lock: Any, check: Callable[[], None] | None, what: str, timeout_s: float = 30.0) -> None:
    """Acquire a multiprocessing lock (or semaphore), polling: `check` (the owner's "is my peer
    alive?", which raises when it is not) runs while another process holds it, and after
    `timeout_s` this gives up with WaitTimeoutError rather than hang behind a dead holder."""
    from rlplex.errors import WaitTimeoutError

    deadline = time.monotonic() + timeout_s
    while not lock.acquire(timeout=_POLL_S):
        try:
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise WaitTimeoutError(f"{what} not acquired within {timeout_s:g} s")
        except BaseException:
            # The error's traceback keeps this frame alive: not the lock with it (a named
            # semaphore is unlinked only when its last reference goes).
            del lock
            raise
