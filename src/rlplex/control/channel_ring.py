"""The ring inside a `LocalDataChannel` file: its layout, its lock, and waiting on it.

A channel file holds a header, a table of `capacity` slot records, and `capacity` data slots
of `slot_bytes` each. The header carries the positions, counters and two futex words:
PUT_SEQ (bumped when an item is published; getters sleep on it) and GET_SEQ (bumped when a
slot is freed; putters sleep on it); `close()` bumps both. The ring is guarded by `flock`
on the file, which the kernel drops when its holder dies, so a SIGKILLed process never
leaves the lock held. What the slots mean (the queue's protocol) is `channel_local`'s.
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

from rlplex.control.channel import ChannelTimeoutError
from rlplex.control.shm_sync import FUTEX

__all__ = ["Ring", "format_ring", "ring_size"]

MAGIC = b"RLPXCH01"
LIVENESS_S = 0.2  # how often a blocked caller looks for a dead peer holding the slot it waits on

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
        self._open()

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_RDWR)
        self._pid = os.getpid()
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

    def lose(self, index: int) -> None:
        """Free slot `index`, counting its item as lost."""
        self.set_slot(index, FREE, 0)
        self.set(LOST, self.u64(LOST) + 1)

    # ---- lock and waits --------------------------------------------------------------------

    def acquire(self) -> None:
        if self._pid != os.getpid():  # forked: a fresh open file description, or flock would be shared
            self._tlock = threading.Lock()
            self._open()
        self._tlock.acquire()
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._tlock.release()

    def _word(self, word_offset: int) -> Any:
        return self._put_word if word_offset == PUT_SEQ else self._get_word

    def bump(self, word_offset: int, waiters_offset: int) -> None:
        """With the lock held: change the futex word, waking its sleepers if there are any."""
        value = (_I.unpack_from(self._mm, word_offset)[0] + 1) & 0xFFFFFFFF
        _I.pack_into(self._mm, word_offset, value)
        if self.u64(waiters_offset):
            FUTEX.wake(self._word(word_offset))

    def wait(self, word_offset: int, waiters_offset: int, deadline: float | None, what: str) -> None:
        """Sleep (lock held on entry and exit) until the word changes, LIVENESS_S passes, or the deadline."""
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise ChannelTimeoutError(f"channel {self.name!r}: {what}")
        seq = _I.unpack_from(self._mm, word_offset)[0]
        self.set(waiters_offset, self.u64(waiters_offset) + 1)
        self.release()
        try:
            wait_s = LIVENESS_S if deadline is None else min(LIVENESS_S, deadline - now)
            FUTEX.wait(self._word(word_offset), seq, wait_s)
        finally:
            self.acquire()
            self.set(waiters_offset, max(0, self.u64(waiters_offset) - 1))
