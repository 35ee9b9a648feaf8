"""`SequenceBuffer`: the metadata buffer that decides when each MFC can run (the seed's
AsyncIOSequenceBuffer).

It holds metadata only: per datapoint an id, the keys present (a bitmask), a length, a
birth time, and which consumers have read and which have finished it. Tensors stay with
the workers that produced them.

Readiness is indexed, not scanned: when a datapoint gains keys, every consumer whose input
keys are now all present pushes it onto that consumer's heap, ordered by birth time, so
`get_batch_for_rpc` pops the oldest ready datapoints in O(log n) each. A datapoint is freed
when its last consumer has *finished* with it (AReaL freed on read, which let a slow
consumer lose data); freeing makes room for blocked producers (backpressure).

All methods run on one asyncio event loop; nothing here is thread-safe by design.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlplex.dataflow.mfc import MFCDef
from rlplex.errors import RlplexError, WaitTimeoutError


class BufferError_(RlplexError):
    """Misuse of the buffer: unknown ids, keys or consumers, a batch size below 1 or above the
    capacity. A call that raises it has changed nothing."""


class BufferClosedError(RlplexError):
    """The buffer was closed while a caller waited on it."""


@dataclass
class _Entry:
    keys: int
    seqlen: int
    birth: float
    read: int = 0
    finished: int = 0


@dataclass(frozen=True)
class BatchMeta:
    ids: tuple[int, ...]
    seqlens: tuple[int, ...]
    birth_times: tuple[float, ...]


class SequenceBuffer:
    def __init__(self, consumers: Sequence[MFCDef], keys: Sequence[str], capacity: int) -> None:
        if capacity < 1:
            raise BufferError_(f"capacity must be at least 1 (got {capacity})")
        self.capacity = capacity
        self._key_bit = {key: 1 << i for i, key in enumerate(dict.fromkeys(keys))}
        self._consumers = {mfc.name: mfc for mfc in consumers}
        self._need = {mfc.name: self._mask(mfc.input_keys, f"MFC {mfc.name!r}") for mfc in consumers}
        self._consumer_bit = {name: 1 << j for j, name in enumerate(self._consumers)}
        self._all_consumers = sum(self._consumer_bit.values())
        self._entries: dict[int, _Entry] = {}
        self._ready: dict[str, list[tuple[float, int]]] = {name: [] for name in self._consumers}
        self._data_event = {name: asyncio.Event() for name in self._consumers}
        self._space_event = asyncio.Event()
        self._waiting: dict[str, tuple[int, float]] = {}  # MFC -> (batch size, since when)
        self._next_id = 0
        self._closed = False

    # ----- helpers ------------------------------------------------------------------------
    def _mask(self, keys: Sequence[str], who: str) -> int:
        mask = 0
        for key in keys:
            try:
                mask |= self._key_bit[key]
            except KeyError:
                raise BufferError_(f"{who}: unknown key {key!r}; the buffer knows {list(self._key_bit)}") from None
        return mask

    def _index(self, datapoint_id: int, entry: _Entry, old_keys: int) -> None:
        for name, need in self._need.items():
            if entry.keys & need == need and old_keys & need != need and not entry.read & self._consumer_bit[name]:
                heapq.heappush(self._ready[name], (entry.birth, datapoint_id))
                self._data_event[name].set()

    def _consumer(self, mfc: MFCDef | str, op: str) -> str:
        name = mfc if isinstance(mfc, str) else mfc.name
        if name not in self._consumers:
            raise BufferError_(f"{op}: {name!r} is not a consumer of this buffer; consumers: {list(self._consumers)}")
        return name

    def _check_open(self) -> None:
        if self._closed:
            raise BufferClosedError("the sequence buffer is closed")

    @property
    def size(self) -> int:
        return len(self._entries)

    def __contains__(self, datapoint_id: object) -> bool:
        return datapoint_id in self._entries

    def ready_count(self, mfc_name: str) -> int:
        return len(self._ready[mfc_name])

    # ----- producers ----------------------------------------------------------------------
    async def put_batch(
        self,
        keys: Sequence[str],
        seqlens: Sequence[int],
        timeout: float | None = None,
        birth_times: Sequence[float] | None = None,
    ) -> list[int]:
        """Add datapoints holding `keys`; waits for room (backpressure). Returns their ids."""
        self._check_open()
        n = len(seqlens)
        if birth_times is not None and len(birth_times) != n:
            raise BufferError_(f"put_batch: {len(birth_times)} birth times for {n} datapoints")
        if n > self.capacity:
            raise BufferError_(f"a batch of {n} datapoints can never fit a buffer of capacity {self.capacity}")
        mask = self._mask(keys, "put_batch")
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(self._entries) + n > self.capacity:
            self._check_open()
            self._space_event.clear()
            await self._wait(self._space_event, deadline, lambda: f"room for {n} datapoints (full at {self.capacity})")
        self._check_open()
        now = time.monotonic()
        ids = list(range(self._next_id, self._next_id + n))
        self._next_id += n
        for i, datapoint_id in enumerate(ids):
            entry = _Entry(mask, int(seqlens[i]), birth_times[i] if birth_times is not None else now)
            self._entries[datapoint_id] = entry
            self._index(datapoint_id, entry, 0)
        return ids

    def amend_batch(self, ids: Sequence[int], keys: Sequence[str]) -> None:
        """Record that `keys` are now present on datapoints `ids`."""
        mask = self._mask(keys, "amend_batch")
        entries = self._entries
        missing = [i for i in ids if i not in entries]
        if missing:
            raise BufferError_(f"amend_batch: datapoints {missing[:10]} are not in the buffer (freed or never put)")
        for datapoint_id in ids:
            entry = entries[datapoint_id]
            old = entry.keys
            entry.keys = old | mask
            if entry.keys != old:
                self._index(datapoint_id, entry, old)

    # ----- consumers ----------------------------------------------------------------------
    async def get_batch_for_rpc(
        self, mfc: MFCDef | str, n: int | None = None, timeout: float | None = None
    ) -> BatchMeta:
        """Wait until `n` (default: the MFC's n_seqs) datapoints hold all its input keys; oldest first."""
        name = self._consumer(mfc, "get_batch_for_rpc")
        self._check_open()  # a closed buffer hands out nothing, even what is ready
        if n is None:
            n = self._consumers[name].n_seqs
        if n < 1:
            raise BufferError_(f"get_batch_for_rpc: MFC {name!r} asks for {n} datapoints; at least 1")
        if n > self.capacity:
            raise BufferError_(f"MFC {name!r} asks for {n} datapoints but the buffer holds at most {self.capacity}")
        heap, event = self._ready[name], self._data_event[name]
        deadline = None if timeout is None else time.monotonic() + timeout
        self._waiting[name] = (n, time.monotonic())
        try:
            while len(heap) < n:
                event.clear()
                await self._wait(event, deadline, lambda: f"{n} datapoints ready for MFC {name!r}\n{self.dump()}")
                self._check_open()
        finally:
            self._waiting.pop(name, None)
        bit, entries, pop = self._consumer_bit[name], self._entries, heapq.heappop
        popped = [pop(heap) for _ in range(n)]
        ids = tuple(datapoint_id for _, datapoint_id in popped)
        seqlens = []
        for datapoint_id in ids:
            entry = entries[datapoint_id]
            entry.read |= bit
            seqlens.append(entry.seqlen)
        return BatchMeta(ids, tuple(seqlens), tuple(birth for birth, _ in popped))

    def finish(self, mfc: MFCDef | str, ids: Sequence[int]) -> list[int]:
        """Mark `ids` finished by `mfc`; returns the ids freed because every consumer is done.

        All or nothing: every id is checked before any is marked, so a bad id frees nothing."""
        name = self._consumer(mfc, "finish")
        bit = self._consumer_bit[name]
        entries = self._entries
        bad = [i for i in ids if i not in entries or not entries[i].read & bit]
        if bad:
            raise BufferError_(f"finish: MFC {name!r} never read datapoints {bad[:10]} (freed or never given to it)")
        freed = []
        for datapoint_id in ids:
            entry = entries[datapoint_id]
            entry.finished |= bit
            if entry.finished == self._all_consumers:
                del self._entries[datapoint_id]
                freed.append(datapoint_id)
        if freed:
            self._space_event.set()
        return freed

    def discard(self, ids: Sequence[int]) -> list[int]:
        """Forget `ids` whatever their consumers' state (a failed step); returns those that were held."""
        gone = [i for i in ids if self._entries.pop(i, None) is not None]
        if gone:
            dead = set(gone)
            for heap in self._ready.values():
                # Rare (failure path), so an O(n) rebuild keeps the hot path free of tombstones.
                if any(i in dead for _, i in heap):
                    heap[:] = [item for item in heap if item[1] not in dead]
                    heapq.heapify(heap)
            self._space_event.set()
        return gone

    # ----- lifecycle and debugging --------------------------------------------------------
    def close(self) -> None:
        """Wake every waiter; they raise `BufferClosedError`."""
        self._closed = True
        self._space_event.set()
        for event in self._data_event.values():
            event.set()

    async def _wait(self, event: asyncio.Event, deadline: float | None, what: Callable[[], str]) -> None:
        # `what` is rendered only on timeout, so the dump shows the state that caused it.
        if deadline is None:
            await event.wait()
            return
        remaining = deadline - time.monotonic()
        try:
            await asyncio.wait_for(event.wait(), timeout=max(remaining, 0.0))
        except TimeoutError:
            raise WaitTimeoutError(f"timed out waiting for {what()}") from None

    def dump(self, max_ids: int = 8) -> str:
        """Which MFC waits for which keys on which datapoints (the watchdog prints this)."""
        names = {bit: key for key, bit in self._key_bit.items()}
        lines = [f"SequenceBuffer: {len(self._entries)}/{self.capacity} datapoints"]
        for name, (n, since) in self._waiting.items():
            need, bit = self._need[name], self._consumer_bit[name]
            lines.append(
                f"  MFC {name!r} waits for {n} ready datapoints ({len(self._ready[name])} ready) "
                f"for {time.monotonic() - since:.1f}s"
            )
            shown = 0
            for datapoint_id, entry in self._entries.items():
                if entry.read & bit or entry.keys & need == need:
                    continue
                missing = [names[b] for b in names if need & b and not entry.keys & b]
                lines.append(f"    id {datapoint_id}: missing {missing}")
                shown += 1
                if shown >= max_ids:
                    break
        return "\n".join(lines)
