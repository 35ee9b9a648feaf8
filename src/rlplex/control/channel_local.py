"""`LocalDataChannel`: a `DataChannel` between processes of one machine, through shared memory.

Design. One file per channel in /dev/shm (`rlplex-ch-<name>`, mode 0600) holds a header, a
ring of `capacity` slots of `slot_bytes` each, and two futex words. An item is encoded as a
msgpack header followed by the raw bytes of its arrays (`rlplex.control.channel`), copied
straight into its slot: a 1 MB array costs one memcpy in and one out, never a pickle or a
pipe. Items larger than a slot go to a per-item overflow segment (`rlplex-ch-<name>@...`)
whose name travels in the slot. The ring is guarded by `flock` on the channel file, which
the kernel drops when its holder dies, so a SIGKILLed process never leaves the lock held;
blocked callers sleep on Linux futexes in the shared header and are woken by the peer that
changes the state (`close()` wakes all). There is no broker process: any process of the
job can `attach(name)`, including unrelated ones started by a scheduler, and a channel
passed to a `spawn` child re-attaches by name. Small items are copied under the lock; large
ones reserve a slot (WRITING / READING, tagged with the pid), copy outside the lock, then
publish or free it, so producers and consumers copy in parallel.

Which failures lose what (the lesson of DLRover's queue, which died with its owner):
- The channel belongs to no process. Queued items survive the death of every producer,
  consumer and of the creator; they live until `unlink()` (the job's cleanup, or
  `LocalDataChannel.cleanup(prefix)`) or a reboot. Nothing is persisted to disk.
- A producer killed while copying a large item loses that one item: getters that wait on
  its slot see its pid gone (within `LIVENESS_S`) and skip it. Its earlier items are intact.
- A consumer killed while copying a large item out loses that item; the slot is reclaimed
  when a producer reaches it. Items it had already returned from `get()` are its
  application's to lose; the channel has no acknowledgements (no redelivery).
- A process killed inside the lock (a few header writes) leaves at worst the item it was
  moving; every partial state is recovered as one of the two cases above.
Each lost item is counted in `stats()["lost"]`. Pids are checked in this pid namespace only;
the channel is for processes of one machine (use `RayDataChannel` across machines).
Linux only (/dev/shm, flock, futex); elsewhere `create` raises `ChannelError`.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import struct
import sys
import threading
import time
from itertools import count
from pathlib import Path
from typing import Any

from rlplex.control.channel import (
    ChannelClosedError,
    ChannelError,
    ChannelTimeoutError,
    Encoded,
    decode_item,
    encode_item,
    validate_channel_name,
)

__all__ = ["LocalDataChannel"]

SHM_DIR = Path("/dev/shm")
FILE_PREFIX = "rlplex-ch-"
LIVENESS_S = 0.2  # how often a blocked caller looks for a dead peer holding the slot it waits on
INLINE_BYTES = 64 << 10  # items up to this size are copied under the lock (one lock round trip)

_MAGIC = b"RLPXCH01"
# Header: magic, capacity, slot_bytes, closed, head, tail, waiting getters, waiting putters, lost;
# then two u32 futex words: PUT_SEQ (bumped when an item is published; getters sleep on it) and
# GET_SEQ (bumped when a slot is freed; putters sleep on it). Both are bumped by close().
_CAPACITY, _SLOT_BYTES, _CLOSED, _HEAD, _TAIL, _WAIT_GET, _WAIT_PUT, _LOST = (8 * i for i in range(1, 9))
_PUT_SEQ, _GET_SEQ = 80, 88
_SLOTS_AT = 128
_SLOT = struct.Struct("<QQQQ")  # state, pid, kind, total bytes
_FREE, _WRITING, _READY, _READING = 0, 1, 2, 3
_INLINE, _OVERFLOW, _ABANDONED = 0, 1, 2
_Q = struct.Struct("<Q")
_I = struct.Struct("<I")


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class _Futex:
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
        if self._syscall is not None:
            args = (ctypes.c_void_p(ctypes.addressof(word)), ctypes.c_int(self._WAKE), ctypes.c_int(2**31 - 1))
            self._syscall(ctypes.c_long(self._number), *args, None, None, ctypes.c_int(0))


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


FUTEX = _Futex()


def pid_alive(pid: int) -> bool:
    """False once `pid` has exited (a zombie counts as exited: it will never touch the channel again)."""
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


class LocalDataChannel:
    """A bounded FIFO in /dev/shm shared by any processes of this machine that know its name."""

    def __init__(self, name: str, path: Path, created: bool):
        # Use `create` / `attach`; this only maps an existing, initialised channel file.
        self._name = name
        self._path = path
        self._created = created
        self._tlock = threading.Lock()  # flock does not exclude threads sharing one descriptor
        self._overflow_ids = count()
        self._open()

    # ---- lifecycle -------------------------------------------------------------------------

    @classmethod
    def create(
        cls, name: str, capacity: int = 16, slot_bytes: int = 2 << 20, *, exist_ok: bool = False
    ) -> LocalDataChannel:
        """Create the channel `name`; its memory (capacity x slot_bytes) is reserved at once."""
        validate_channel_name(name)
        if capacity < 1 or slot_bytes < 256:
            raise ChannelError(f"channel {name!r}: capacity {capacity} must be >= 1, slot_bytes {slot_bytes} >= 256")
        if not SHM_DIR.is_dir():
            raise ChannelError(f"channel {name!r}: LocalDataChannel needs Linux shared memory at {SHM_DIR}")
        slot_bytes = _align(slot_bytes, 64)
        data_at = _align(_SLOTS_AT + _SLOT.size * capacity, 4096)
        path = SHM_DIR / f"{FILE_PREFIX}{name}"
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            if exist_ok:
                return cls.attach(name)
            raise ChannelError(f"channel {name!r} already exists at {path}") from None
        try:
            # Reserve every page now: a full /dev/shm then fails here, not as a SIGBUS mid-put.
            os.posix_fallocate(fd, 0, data_at + capacity * slot_bytes)
            with mmap.mmap(fd, _SLOTS_AT) as header:
                for offset, value in ((_CAPACITY, capacity), (_SLOT_BYTES, slot_bytes)):
                    _Q.pack_into(header, offset, value)
                header[:8] = _MAGIC  # last: attachers treat a file without magic as not ready
        except OSError as error:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise ChannelError(f"channel {name!r}: cannot reserve {capacity} x {slot_bytes} bytes: {error}") from error
        os.close(fd)
        return cls(name, path, created=True)

    @classmethod
    def attach(cls, name: str, timeout: float = 0.0) -> LocalDataChannel:
        """Map the existing channel `name`, waiting up to `timeout` s for its creator."""
        validate_channel_name(name)
        path = SHM_DIR / f"{FILE_PREFIX}{name}"
        deadline = time.monotonic() + timeout
        while True:
            try:
                with open(path, "rb") as file:
                    if file.read(8) == _MAGIC:
                        return cls(name, path, created=False)
            except FileNotFoundError:
                pass
            if time.monotonic() >= deadline:
                raise ChannelError(f"channel {name!r} does not exist at {path} (waited {timeout} s for its creator)")
            time.sleep(0.01)  # no notification exists for a file appearing; polled only while attaching

    def _open(self) -> None:
        self._fd = os.open(self._path, os.O_RDWR)
        self._pid = os.getpid()
        self._mm = mmap.mmap(self._fd, 0)
        self._view = memoryview(self._mm)
        self._capacity = self._u64(_CAPACITY)
        self._slot_bytes = self._u64(_SLOT_BYTES)
        self._data_at = _align(_SLOTS_AT + _SLOT.size * self._capacity, 4096)
        self._put_word = FUTEX.word(self._mm, _PUT_SEQ)
        self._get_word = FUTEX.word(self._mm, _GET_SEQ)

    def detach(self) -> None:
        """Unmap this handle; the channel and its items stay for the other processes."""
        if self._mm.closed:
            return
        del self._put_word, self._get_word  # ctypes views pin the mapping open
        self._view.release()
        self._mm.close()
        os.close(self._fd)

    def unlink(self) -> None:
        """Remove the channel's files (and its overflow segments); mapped handles keep working."""
        self.unlink_name(self._name)

    @staticmethod
    def unlink_name(name: str) -> None:
        LocalDataChannel.cleanup(prefix=name, exact=True)

    @staticmethod
    def cleanup(prefix: str = "", exact: bool = False) -> list[str]:
        """Unlink every channel whose name starts with `prefix` (a job id); returns the files removed."""
        removed = []
        pattern = f"{FILE_PREFIX}{prefix}{'' if exact else '*'}"
        for path in [*SHM_DIR.glob(pattern), *SHM_DIR.glob(f"{pattern}@*")]:
            path.unlink(missing_ok=True)
            removed.append(path.name)
        return removed

    def __enter__(self) -> LocalDataChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        """The creating handle closes and unlinks the channel; an attached one only detaches."""
        if self._created and not self._mm.closed:
            self.close()
            self.unlink()
        self.detach()

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # A spawned child maps the channel by name; only the name crosses the process boundary.
        return (LocalDataChannel.attach, (self._name,))

    def __repr__(self) -> str:
        return f"LocalDataChannel({self._name!r}, capacity={self._capacity})"

    # ---- shared header ---------------------------------------------------------------------

    def _u64(self, offset: int) -> int:
        return int(_Q.unpack_from(self._mm, offset)[0])

    def _set(self, offset: int, value: int) -> None:
        _Q.pack_into(self._mm, offset, value)

    def _slot(self, index: int) -> tuple[int, int, int, int]:
        return _SLOT.unpack_from(self._mm, _SLOTS_AT + _SLOT.size * index)

    def _set_slot(self, index: int, state: int, pid: int, kind: int = 0, total: int = 0) -> None:
        _SLOT.pack_into(self._mm, _SLOTS_AT + _SLOT.size * index, state, pid, kind, total)

    def _data(self, index: int, nbytes: int) -> memoryview:
        start = self._data_at + index * self._slot_bytes
        return self._view[start : start + nbytes]

    def _acquire(self) -> None:
        if self._pid != os.getpid():  # forked: a fresh open file description, or flock would be shared
            self._tlock = threading.Lock()
            self._open()
        self._tlock.acquire()
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def _release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._tlock.release()

    def _bump(self, word_offset: int, waiters_offset: int) -> None:
        value = (_I.unpack_from(self._mm, word_offset)[0] + 1) & 0xFFFFFFFF
        _I.pack_into(self._mm, word_offset, value)
        if self._u64(waiters_offset):
            FUTEX.wake(self._put_word if word_offset == _PUT_SEQ else self._get_word)

    def _wait(self, word_offset: int, waiters_offset: int, deadline: float | None, what: str) -> None:
        """Sleep (lock held on entry and exit) until the word changes, LIVENESS_S passes, or the deadline."""
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise ChannelTimeoutError(f"channel {self._name!r}: {what}")
        seq = _I.unpack_from(self._mm, word_offset)[0]
        self._set(waiters_offset, self._u64(waiters_offset) + 1)
        self._release()
        try:
            wait_s = LIVENESS_S if deadline is None else min(LIVENESS_S, deadline - now)
            FUTEX.wait(self._put_word if word_offset == _PUT_SEQ else self._get_word, seq, wait_s)
        finally:
            self._acquire()
            self._set(waiters_offset, max(0, self._u64(waiters_offset) - 1))

    def _lose(self, index: int) -> None:
        self._set_slot(index, _FREE, 0)
        self._set(_LOST, self._u64(_LOST) + 1)

    # ---- DataChannel -----------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def closed(self) -> bool:
        return bool(self._u64(_CLOSED))

    def qsize(self) -> int:
        return self._u64(_TAIL) - self._u64(_HEAD)

    def stats(self) -> dict[str, int]:
        """Counters for monitoring and tests: positions, blocked callers, items lost to dead peers."""
        keys = {"head": _HEAD, "tail": _TAIL, "closed": _CLOSED, "lost": _LOST}
        stats = {key: self._u64(offset) for key, offset in keys.items()}
        stats.update(waiting_getters=self._u64(_WAIT_GET), waiting_putters=self._u64(_WAIT_PUT))
        return stats

    def close(self) -> None:
        self._acquire()
        try:
            self._set(_CLOSED, 1)
            self._bump(_PUT_SEQ, _WAIT_GET)
            self._bump(_GET_SEQ, _WAIT_PUT)
        finally:
            self._release()

    def put(self, item: Any, timeout: float | None = None) -> None:
        encoded = encode_item(item)
        size = encoded.size
        overflow = self._write_overflow(encoded) if size > self._slot_bytes else None
        deadline = None if timeout is None else time.monotonic() + timeout
        self._acquire()
        try:
            index = self._reserve(deadline, timeout)
            tail = self._u64(_TAIL)
            if overflow is not None or size <= INLINE_BYTES:
                if overflow is not None:
                    segment = overflow.encode()
                    self._data(index, len(segment))[:] = segment
                    self._set_slot(index, _READY, 0, _OVERFLOW, len(segment))
                else:
                    encoded.write(self._data(index, size))
                    self._set_slot(index, _READY, 0, _INLINE, size)
                self._set(_TAIL, tail + 1)
                self._bump(_PUT_SEQ, _WAIT_GET)
                return
            self._set_slot(index, _WRITING, os.getpid())
            self._set(_TAIL, tail + 1)
        except BaseException:
            if overflow is not None:
                (SHM_DIR / overflow).unlink(missing_ok=True)
            raise
        finally:
            self._release()
        kind = _ABANDONED
        try:
            encoded.write(self._data(index, size))
            kind = _INLINE
        finally:  # even when the copy is interrupted, getters must not wait on this slot forever
            self._acquire()
            try:
                self._set_slot(index, _READY, 0, kind, size)
                self._bump(_PUT_SEQ, _WAIT_GET)
            finally:
                self._release()

    def _reserve(self, deadline: float | None, timeout: float | None) -> int:
        """With the lock held: wait for the slot at the tail to be free; return its index."""
        while True:
            if self._u64(_CLOSED):
                raise ChannelClosedError(f"channel {self._name!r} is closed; cannot put")
            head, tail = self._u64(_HEAD), self._u64(_TAIL)
            index = tail % self._capacity
            state, pid, _, _ = self._slot(index)
            if state == _FREE:
                return index
            # A busy slot behind the head belongs to a reader copying out. Anything else there
            # (a dead reader's slot, a claim or reserve cut short) is reclaimed: that item is lost.
            behind_head = tail - head < self._capacity
            if behind_head and not (state in (_READING, _WRITING) and pid_alive(pid)):
                self._lose(index)
                continue
            self._wait(_GET_SEQ, _WAIT_PUT, deadline, f"put timed out after {timeout} s: full ({self._capacity} items)")

    def get(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._acquire()
        try:
            index, kind, total = self._claim(deadline, timeout)
            if kind == _INLINE and total <= INLINE_BYTES:
                try:
                    return decode_item(self._data(index, total))
                finally:
                    self._set_slot(index, _FREE, 0)
                    self._bump(_GET_SEQ, _WAIT_PUT)
        finally:
            self._release()
        try:
            if kind == _OVERFLOW:
                return self._read_overflow(bytes(self._data(index, total)).decode())
            return decode_item(self._data(index, total))
        finally:
            self._acquire()
            try:
                self._set_slot(index, _FREE, 0)
                self._bump(_GET_SEQ, _WAIT_PUT)
            finally:
                self._release()

    def _claim(self, deadline: float | None, timeout: float | None) -> tuple[int, int, int]:
        """With the lock held: wait for a ready item at the head, take it off the ring (head + 1)."""
        while True:
            head, tail = self._u64(_HEAD), self._u64(_TAIL)
            if head == tail:
                if self._u64(_CLOSED):
                    raise ChannelClosedError(f"channel {self._name!r} is closed and drained")
                self._wait(_PUT_SEQ, _WAIT_GET, deadline, f"get timed out after {timeout} s: empty")
                continue
            index = head % self._capacity
            state, pid, kind, total = self._slot(index)
            if state == _READY and kind != _ABANDONED:
                # Marked ours before the head moves, so a death in between leaves a dead reader's slot.
                self._set_slot(index, _READING, os.getpid(), kind, total)
                self._set(_HEAD, head + 1)
                return index, kind, total
            if state == _WRITING and pid_alive(pid):
                self._wait(_PUT_SEQ, _WAIT_GET, deadline, f"get timed out after {timeout} s: waiting for a writer")
                continue
            # Abandoned by a writer that died or was interrupted, or left half-claimed by a dead reader.
            if kind != _ABANDONED or state != _READY:
                self._lose(index)
            else:
                self._set_slot(index, _FREE, 0)
            self._set(_HEAD, head + 1)
            self._bump(_GET_SEQ, _WAIT_PUT)

    def get_batch(self, max_items: int, timeout: float | None = None) -> list[Any]:
        items = [self.get(timeout)]
        while len(items) < max_items:
            try:
                items.append(self.get(timeout=0))
            except (ChannelTimeoutError, ChannelClosedError):
                break
        return items

    # ---- items larger than a slot ----------------------------------------------------------

    def _write_overflow(self, encoded: Encoded) -> str:
        size = encoded.size
        name = f"{FILE_PREFIX}{self._name}@{os.getpid()}-{next(self._overflow_ids)}"
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
            with mmap.mmap(fd, size) as segment, memoryview(segment) as view:
                encoded.write(view)
        except OSError as error:
            (SHM_DIR / name).unlink(missing_ok=True)
            raise ChannelError(
                f"channel {self._name!r}: cannot hold a {size}-byte item in shared memory: {error}"
            ) from error
        finally:
            os.close(fd)
        return name

    def _read_overflow(self, name: str) -> Any:
        path = SHM_DIR / name
        try:
            with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as segment:
                with memoryview(segment) as view:
                    return decode_item(view)
        finally:
            path.unlink(missing_ok=True)
