"""`LocalDataChannel`: a `DataChannel` between processes of one machine, through shared memory.

Design. One file per channel in /dev/shm (`rlplex-ch-<name>`, mode 0600) holds a header, a
ring of `capacity` slots of `slot_bytes` each, and two futex words. An item is encoded as a
msgpack header followed by the raw bytes of its arrays (`rlplex.control.channels.base`), copied
straight into its slot: a 1 MB array costs one memcpy in and one out, never a pickle or a
pipe. Items larger than a slot go to a per-item overflow segment (`rlplex-ch-<name>@...`)
whose name travels in the slot. The ring is guarded by `flock` on the channel file, which
the kernel drops when its holder dies, so a SIGKILLed process never leaves the lock held;
blocked callers poll briefly, then sleep on Linux futexes in the shared header and are
woken by the peer that changes the state (`close()` wakes all). There is no broker process:
any process of the job can `attach(name)`, including unrelated ones started by a scheduler,
and a channel passed to a `spawn` child re-attaches by name. Small items (up to
INLINE_BYTES) are copied in and out under the lock, one lock round trip per call; large ones
reserve a slot (WRITING / READING, tagged with the pid), copy outside the lock, then publish
or free it, so producers and consumers copy in parallel. This module is the queue's
protocol; the file's layout, lock and waits are `ring`'s, the copying of items into
shared-memory files `shm_transport`'s, and futexes and pid liveness `rlplex.io.shm_sync`'s.

Which failures lose what (the lesson of DLRover's queue, which died with its owner):
- The channel belongs to no process. Queued items survive the death of every producer,
  consumer and of the creator; they live until `unlink()`, `LocalDataChannel.cleanup(prefix)`,
  the end of the job that owns them (named by `WorkerContext.channel_name`: the job's stop or
  failure unlinks them on the master's machine) or a reboot. Nothing is persisted to disk.
- A producer killed while copying a large item loses that one item: getters that wait on
  its slot see its pid gone (within `ring.LIVENESS_S`) and skip it. Its earlier items are intact.
- A consumer killed while copying a large item out loses that item; the slot is reclaimed
  when a producer reaches it. Items it had already returned from `get()` are its
  application's to lose; the channel has no acknowledgements (no redelivery).
- A process killed inside the lock leaves at worst the item it was moving; every partial
  state is recovered as one of the two cases above. A getter killed while it decodes a small
  item (under the lock) leaves that item at the head for the next getter.
Each lost item is counted in `stats()["lost"]`. Pids are checked in this pid namespace only;
the channel is for processes of one machine (use `RayDataChannel` across machines).
Linux only (/dev/shm, flock, futex); elsewhere `create` raises `ChannelError`.
"""

from __future__ import annotations

import os
import time
from itertools import count
from typing import Any

from rlplex.control.channels.base import (
    ChannelClosedError,
    ChannelError,
    ChannelTimeoutError,
    Encoded,
    decode_item,
    encode_item,
    validate_channel_name,
)
from rlplex.control.channels.ring import (
    ABANDONED,
    CLOSED,
    FREE,
    GET_SEQ,
    HEAD,
    INLINE,
    LOST,
    OVERFLOW,
    PUT_SEQ,
    READING,
    READY,
    TAIL,
    WAIT_GET,
    WAIT_PUT,
    WRITING,
    Ring,
    format_ring,
    is_formatted,
    ring_size,
)
from rlplex.control.channels.shm_transport import SHM_DIR, create_reserved, read_segment, unlink_matching, write_segment
from rlplex.io.shm_sync import pid_alive

__all__ = ["LocalDataChannel"]

FILE_PREFIX = "rlplex-ch-"
INLINE_BYTES = 64 << 10  # items up to this size are copied under the lock (one lock round trip)


class LocalDataChannel:
    """A bounded FIFO in /dev/shm shared by any processes of this machine that know its name."""

    def __init__(self, name: str, ring: Ring, created: bool):
        # Use `create` / `attach`; this only wraps a mapped, initialised channel file.
        self._name = name
        self._ring = ring
        self._created = created
        self._overflow_ids = count()
        self._inline_limit = min(INLINE_BYTES, ring.slot_bytes)  # items copied under the lock

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
        path = SHM_DIR / f"{FILE_PREFIX}{name}"
        try:
            fd = create_reserved(path, ring_size(capacity, slot_bytes))
        except FileExistsError:
            if exist_ok:  # another process creates it: wait for it to be formatted
                return cls.attach(name, timeout=10.0)
            raise ChannelError(f"channel {name!r} already exists at {path}") from None
        except OSError as error:
            raise ChannelError(f"channel {name!r}: cannot reserve {capacity} x {slot_bytes} bytes: {error}") from error
        try:
            format_ring(fd, capacity, slot_bytes)
        except OSError as error:
            path.unlink(missing_ok=True)
            raise ChannelError(f"channel {name!r}: cannot write its header at {path}: {error}") from error
        finally:
            os.close(fd)
        return cls(name, Ring(name, path), created=True)

    @classmethod
    def attach(cls, name: str, timeout: float = 0.0) -> LocalDataChannel:
        """Map the existing channel `name`, waiting up to `timeout` s for its creator."""
        validate_channel_name(name)
        path = SHM_DIR / f"{FILE_PREFIX}{name}"
        deadline = time.monotonic() + timeout
        while not is_formatted(path):
            if time.monotonic() >= deadline:
                raise ChannelError(f"channel {name!r} does not exist at {path} (waited {timeout} s for its creator)")
            time.sleep(0.01)  # no notification exists for a file appearing; polled only while attaching
        return cls(name, Ring(name, path), created=False)

    def detach(self) -> None:
        """Unmap this handle; the channel and its items stay for the other processes."""
        self._ring.detach()

    def unlink(self) -> None:
        """Remove the channel's files (and its overflow segments); mapped handles keep working."""
        self.unlink_name(self._name)

    @staticmethod
    def unlink_name(name: str) -> None:
        LocalDataChannel.cleanup(prefix=name, exact=True)

    @staticmethod
    def cleanup(prefix: str = "", exact: bool = False) -> list[str]:
        """Unlink every channel whose name starts with `prefix` (a job id); returns the files removed."""
        pattern = f"{FILE_PREFIX}{prefix}{'' if exact else '*'}"
        return [*unlink_matching(pattern), *unlink_matching(f"{pattern}@*")]

    def __enter__(self) -> LocalDataChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        """The creating handle closes and unlinks the channel; an attached one only detaches."""
        if self._created and self._ring.mapped:
            self.close()
            self.unlink()
        self.detach()

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # A spawned child maps the channel by name; only the name crosses the process boundary.
        return (LocalDataChannel.attach, (self._name,))

    def __repr__(self) -> str:
        return f"LocalDataChannel({self._name!r}, capacity={self.capacity})"

    # ---- DataChannel -----------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def capacity(self) -> int:
        return self._ring.capacity

    @property
    def closed(self) -> bool:
        return bool(self._ring.u64(CLOSED))

    def qsize(self) -> int:
        return self._ring.u64(TAIL) - self._ring.u64(HEAD)

    def stats(self) -> dict[str, int]:
        """Counters for monitoring and tests: positions, blocked callers, items lost to dead peers."""
        ring = self._ring
        keys = {"head": HEAD, "tail": TAIL, "closed": CLOSED, "lost": LOST}
        stats = {key: ring.u64(offset) for key, offset in keys.items()}
        stats.update(waiting_getters=ring.u64(WAIT_GET), waiting_putters=ring.u64(WAIT_PUT))
        return stats

    def close(self) -> None:
        ring = self._ring
        ring.acquire()
        try:
            ring.set(CLOSED, 1)
            ring.bump(PUT_SEQ, WAIT_GET)
            ring.bump(GET_SEQ, WAIT_PUT)
        finally:
            ring.release()

    def put(self, item: Any, timeout: float | None = None) -> None:
        ring = self._ring
        encoded = encode_item(item)
        size = encoded.size
        deadline = None if timeout is None else time.monotonic() + timeout
        if size <= self._inline_limit:  # the common case (control messages, small rollouts): one lock round trip
            ring.acquire()
            try:
                index, tail = self._reserve_tail(deadline, timeout)
                encoded.write(ring.data(index, size))
                ring.publish(index, tail, INLINE, size)
            finally:
                ring.release()
            return
        overflow = self._write_overflow(encoded) if size > ring.slot_bytes else None
        ring.acquire()
        try:
            index, tail = self._reserve_tail(deadline, timeout)
            if overflow is not None:
                segment = overflow.encode()
                ring.data(index, len(segment))[:] = segment
                ring.publish(index, tail, OVERFLOW, len(segment))
                return
            ring.set_slot(index, WRITING, os.getpid())
            ring.set(TAIL, tail + 1)
        except BaseException:
            if overflow is not None:
                (SHM_DIR / overflow).unlink(missing_ok=True)
            raise
        finally:
            ring.release()
        kind = ABANDONED
        try:
            encoded.write(ring.data(index, size))
            kind = INLINE
        finally:  # even when the copy is interrupted, getters must not wait on this slot forever
            ring.acquire()
            try:
                ring.set_slot(index, READY, 0, kind, size)
                ring.bump(PUT_SEQ, WAIT_GET)
            finally:
                ring.release()

    def _reserve(self, deadline: float | None, timeout: float | None) -> int:
        """With the lock held: wait for the slot at the tail to be free; return its index."""
        return self._reserve_tail(deadline, timeout)[0]

    def _reserve_tail(self, deadline: float | None, timeout: float | None) -> tuple[int, int]:
        """With the lock held: wait for the slot at the tail to be free; return its index and the tail."""
        ring = self._ring
        capacity = ring.capacity
        while True:
            closed, head, tail = ring.positions()
            if closed:
                raise ChannelClosedError(f"channel {self._name!r} is closed; cannot put")
            index = tail % capacity
            state, pid, _, _ = ring.slot(index)
            if state == FREE:
                return index, tail
            # A busy slot behind the head belongs to a reader copying out. Anything else there
            # (a dead reader's slot, a claim or reserve cut short) is reclaimed: that item is lost.
            behind_head = tail - head < capacity
            if behind_head and not (state in (READING, WRITING) and pid_alive(pid)):
                ring.lose(index)
                continue
            ring.wait(GET_SEQ, WAIT_PUT, deadline, f"put timed out after {timeout} s: full ({capacity} items)")

    def get(self, timeout: float | None = None) -> Any:
        ring = self._ring
        deadline = None if timeout is None else time.monotonic() + timeout
        ring.acquire()
        try:
            head, index, kind, total = self._ready(deadline, timeout)
            if kind == INLINE and total <= INLINE_BYTES:
                # Decoded under the lock, the item never needs the READING state: a death here
                # leaves it READY at the head for the next getter.
                try:
                    return decode_item(ring.data(index, total))
                finally:
                    ring.dequeue(index, head)
            # Marked ours before the head moves, so a death in between leaves a dead reader's slot.
            ring.set_slot(index, READING, os.getpid(), kind, total)
            ring.set(HEAD, head + 1)
        finally:
            ring.release()
        try:
            if kind == OVERFLOW:
                return read_segment(SHM_DIR / bytes(ring.data(index, total)).decode())
            return decode_item(ring.data(index, total))
        finally:
            ring.acquire()
            try:
                ring.set_slot(index, FREE, 0)
                ring.bump(GET_SEQ, WAIT_PUT)
            finally:
                ring.release()

    def _claim(self, deadline: float | None, timeout: float | None) -> tuple[int, int, int]:
        """With the lock held: wait for a ready item at the head, take it off the ring (head + 1)."""
        head, index, kind, total = self._ready(deadline, timeout)
        self._ring.set_slot(index, READING, os.getpid(), kind, total)
        self._ring.set(HEAD, head + 1)
        return index, kind, total

    def _ready(self, deadline: float | None, timeout: float | None) -> tuple[int, int, int, int]:
        """With the lock held: wait for a ready item at the head; return (head, index, kind, total)."""
        ring = self._ring
        capacity = ring.capacity
        while True:
            closed, head, tail = ring.positions()
            if head == tail:
                if closed:
                    raise ChannelClosedError(f"channel {self._name!r} is closed and drained")
                ring.wait(PUT_SEQ, WAIT_GET, deadline, f"get timed out after {timeout} s: empty")
                continue
            index = head % capacity
            state, pid, kind, total = ring.slot(index)
            if state == READY and kind != ABANDONED:
                return head, index, kind, total
            if state == WRITING and pid_alive(pid):
                ring.wait(PUT_SEQ, WAIT_GET, deadline, f"get timed out after {timeout} s: waiting for a writer")
                continue
            # Abandoned by a writer that died or was interrupted, or left half-claimed by a dead reader.
            if kind != ABANDONED or state != READY:
                ring.lose(index)
            else:
                ring.set_slot(index, FREE, 0)
            ring.set(HEAD, head + 1)
            ring.bump(GET_SEQ, WAIT_PUT)

    def get_batch(self, max_items: int, timeout: float | None = None) -> list[Any]:
        items = [self.get(timeout)]
        while len(items) < max_items:
            try:
                items.append(self.get(timeout=0))
            except (ChannelTimeoutError, ChannelClosedError):
                break
        return items

    def _write_overflow(self, encoded: Encoded) -> str:
        """Put an item larger than a slot in a segment of its own; return the segment's name."""
        name = f"{FILE_PREFIX}{self._name}@{os.getpid()}-{next(self._overflow_ids)}"
        try:
            write_segment(SHM_DIR / name, encoded)
        except OSError as error:
            raise ChannelError(
                f"channel {self._name!r}: cannot hold a {encoded.size}-byte item in shared memory: {error}"
            ) from error
        return name
