"""The ring inside a `LocalDataChannel` file: its layout, its lock, and waiting on it.

A channel file holds a header, a table of `capacity` slot records, and `capacity` data slots
of `slot_bytes` each. The header carries the positions, counters and two futex words:
PUT_SEQ (bumped when an item is published; getters sleep on it) and GET_SEQ (bumped when a
slot is freed; putters sleep on it); `close()` bumps both. The ring is guarded by `flock`
on the file, which the kernel drops when its holder dies, so a SIGKILLed process never
leaves the lock held. What the slots mean (the queue's protocol) is `local`'s.

Waking a sleeping process costs its peer tens of microseconds on a VM (an IPI), more than
moving a small item, so a busy stream avoids sleeping: a caller retries a held lock and
polls a futex word for up to SPIN_S before it sleeps, and a waker wakes once, after its
unlock, and only sleepers that registered since the last wake.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import time
from pathlib import Path
from typing import Any

from rlplex.control.channels.base import ChannelTimeoutError
from rlplex.io.shm_sync import FUTEX

__all__ = ["Ring", "format_ring", "ring_size"]

MAGIC = b"RLPXCH01"
LIVENESS_S = 0.2  # how often a blocked caller looks for a dead peer holding the slot it waits on
SPIN_S = 100e-6  # how long a caller polls before it sleeps on a futex (see `Ring._spin`)

# Header: magic, then u64 capacity, slot_bytes, closed, head, tail, waiting getters, waiting
# putters, lost; then the two u32 futex words.
CAPACITY, SLOT_BYTES, CLOSED, HEAD, TAIL, WAIT_GET, WAIT_PUT, LOST = (8 * i for i in range(1, 9))
PUT_SEQ, GET_SEQ = 80, 88
SLOTS_AT = 128
SLOT = struct.Struct("<QQQQ")  # state, pid, kind, total bytes
# Slot states, and kinds of what a READY slot holds.
FREE, WRITING, READY, READING = 0, 1, 2, 3
INLINE, OVERFLOW, ABANDONED = 0, 1, 2

_Q = struct.Struct("<Q")
_I = struct.Struct("<I")
_POSITIONS = struct.Struct("<QQQ")  # CLOSED, HEAD, TAIL


# Forks of this process so far, counted in the child: a lock call compares it instead of
# asking the kernel for the pid (a syscall per lock).
_FORKS = [0]


def _count_fork() -> None:
    _FORKS[0] += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_count_fork)


def align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def slot_size(slot_bytes: int) -> int:
    """The size a data slot really has: `slot_bytes` rounded up to a cache line."""
    return align(slot_bytes, 64)


def _data_at(capacity: int) -> int:
    return align(SLOTS_AT + SLOT.size * capacity, 4096)


def ring_size(capacity: int, slot_bytes: int) -> int:
    """Bytes of a channel file with `capacity` slots of `slot_size(slot_bytes)`."""
    return _data_at(capacity) + capacity * slot_size(slot_bytes)


def format_ring(fd: int, capacity: int, slot_bytes: int) -> None:
    """Write the header of a new, zero-filled channel file; it is valid once the magic is in."""
    with mmap.mmap(fd, SLOTS_AT) as header:
        _Q.pack_into(header, CAPACITY, capacity)
        _Q.pack_into(header, SLOT_BYTES, slot_size(slot_bytes))
        header[:8] = MAGIC  # last: attachers treat a file without magic as not ready


def is_formatted(path: Path) -> bool:
    """True when the file at `path` exists and its creator has finished writing its header."""
    try:
        with open(path, "rb") as file:
            return file.read(8) == MAGIC
    except FileNotFoundError:
        return False


class Ring:
    """One process's mapping of a channel file: header fields, slots, the lock, and waits."""

    def __init__(self, name: str, path: Path):
        self.name = name  # the channel's, for error messages
        self.path = path
        self._tlock = threading.Lock()  # flock does not exclude threads sharing one descriptor
        self._wakes: list[Any] = []  # futex words to wake once the lock is released
        self._open()

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_RDWR)
        self._forks = _FORKS[0]
        self._mm = mmap.mmap(self._fd, 0)
        self._view = memoryview(self._mm)
        self.capacity = self.u64(CAPACITY)
        self.slot_bytes = self.u64(SLOT_BYTES)
        self._data_at = _data_at(self.capacity)
        self._put_word = FUTEX.word(self._mm, PUT_SEQ)
        self._get_word = FUTEX.word(self._mm, GET_SEQ)

    @property
    def mapped(self) -> bool:
        return not self._mm.closed

    def detach(self) -> None:
        """Unmap; idempotent."""
        if self._mm.closed:
            return
        del self._put_word, self._get_word  # ctypes views pin the mapping open
        self._view.release()
        self._mm.close()
        os.close(self._fd)

    # ---- fields ----------------------------------------------------------------------------

    def u64(self, offset: int) -> int:
        return int(_Q.unpack_from(self._mm, offset)[0])

    def set(self, offset: int, value: int) -> None:
        _Q.pack_into(self._mm, offset, value)

    def slot(self, index: int) -> tuple[int, int, int, int]:
        return SLOT.unpack_from(self._mm, SLOTS_AT + SLOT.size * index)

    def set_slot(self, index: int, state: int, pid: int, kind: int = 0, total: int = 0) -> None:
        SLOT.pack_into(self._mm, SLOTS_AT + SLOT.size * index, state, pid, kind, total)

    def data(self, index: int, nbytes: int) -> memoryview:
        start = self._data_at + index * self.slot_bytes
        return self._view[start : start + nbytes]

    def positions(self) -> tuple[int, int, int]:
        """(closed, head, tail) in one read: they are adjacent in the header."""
        closed, head, tail = _POSITIONS.unpack_from(self._mm, CLOSED)
        return closed, head, tail

    def publish(self, index: int, tail: int, kind: int, total: int) -> None:
        """With the lock held: make slot `index` (at position `tail`) a READY item and wake getters."""
        SLOT.pack_into(self._mm, SLOTS_AT + SLOT.size * index, READY, 0, kind, total)
        _Q.pack_into(self._mm, TAIL, tail + 1)
        self.bump(PUT_SEQ, WAIT_GET)

    def dequeue(self, index: int, head: int) -> None:
        """With the lock held: free slot `index` (the item at position `head`), advance the head, wake putters."""
        SLOT.pack_into(self._mm, SLOTS_AT + SLOT.size * index, FREE, 0, 0, 0)
        _Q.pack_into(self._mm, HEAD, head + 1)
        self.bump(GET_SEQ, WAIT_PUT)

    def lose(self, index: int) -> None:
        """Free slot `index`, counting its item as lost."""
        self.set_slot(index, FREE, 0)
        self.set(LOST, self.u64(LOST) + 1)

    # ---- lock and waits --------------------------------------------------------------------

    def acquire(self) -> None:
        if self._forks != _FORKS[0]:  # forked: a fresh open file description, or flock would be shared
            self._tlock = threading.Lock()
            self._wakes = []
            self._open()
        self._tlock.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._acquire_contended()
        except BaseException:
            self._tlock.release()
            raise

    def _acquire_contended(self) -> None:
        """Take the flock a peer holds: retry for up to SPIN_S, then sleep in the kernel.

        Why: the lock is held for microseconds, but a process that sleeps in flock is woken by
        an IPI from its peer's unlock, tens of microseconds on a VM, paid per item.
        """
        try:
            stop = time.monotonic() + SPIN_S
            while time.monotonic() < stop:
                os.sched_yield()
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return
                except BlockingIOError:
                    pass
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._tlock.release()
            raise

    def release(self) -> None:
        wakes = self._wakes
        if wakes:
            self._wakes = []
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._tlock.release()
        # Woken only now: a sleeper woken while we held the lock would run straight into it and
        # sleep a second time (in flock), two context switches per item instead of one.
        for word in wakes:
            FUTEX.wake(word)

    def _word(self, word_offset: int) -> Any:
        return self._put_word if word_offset == PUT_SEQ else self._get_word

    def bump(self, word_offset: int, waiters_offset: int) -> None:
        """With the lock held: change the futex word; its sleepers are woken by `release`.

        The waiter count is cleared here, so later bumps skip the wake syscall until a caller
        registers again: a sleeper still on its way back to the lock is not woken once per item.
        """
        value = (_I.unpack_from(self._mm, word_offset)[0] + 1) & 0xFFFFFFFF
        _I.pack_into(self._mm, word_offset, value)
        if self.u64(waiters_offset):
            self.set(waiters_offset, 0)
            self._wakes.append(self._word(word_offset))

    def wait(self, word_offset: int, waiters_offset: int, deadline: float | None, what: str) -> None:
        """Sleep (lock held on entry and exit) until the word changes, LIVENESS_S passes, or the deadline."""
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise ChannelTimeoutError(f"channel {self.name!r}: {what}")
        seq = _I.unpack_from(self._mm, word_offset)[0]
        if self._spin(word_offset, seq, now, deadline):
            return
        now = time.monotonic()
        self.set(waiters_offset, self.u64(waiters_offset) + 1)
        self.release()
        try:
            wait_s = LIVENESS_S if deadline is None else min(LIVENESS_S, deadline - now)
            FUTEX.wait(self._word(word_offset), seq, wait_s)
        finally:
            self.acquire()
            # A bump since we registered cleared every registration (ours included); otherwise
            # (a timeout, a liveness check, a signal) ours is still counted and is ours to remove.
            if _I.unpack_from(self._mm, word_offset)[0] == seq:
                self.set(waiters_offset, max(0, self.u64(waiters_offset) - 1))

    def _spin(self, word_offset: int, seq: int, now: float, deadline: float | None) -> bool:
        """Poll the word (lock released) for up to SPIN_S; True if it changed, with the lock held again.

        Why: a busy stream's next item is microseconds away, while a futex sleep makes the peer
        pay a wake syscall that costs tens of microseconds on a VM (an IPI to an idle vCPU),
        which made small items 2-3x slower than multiprocessing.Queue. Spinning is bounded, and
        sched_yield lets a peer that shares our core (or our GIL) run meanwhile.
        """
        stop = now + SPIN_S if deadline is None else min(now + SPIN_S, deadline)
        mm, unpack = self._mm, _I.unpack_from
        self.release()
        changed = False
        try:
            while time.monotonic() < stop:
                if unpack(mm, word_offset)[0] != seq:
                    changed = True
                    break
                os.sched_yield()
        finally:
            self.acquire()
        return changed or unpack(mm, word_offset)[0] != seq
