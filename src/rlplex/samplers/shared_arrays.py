"""Named numpy arrays over `multiprocessing.shared_memory`: what processes share without
pickling bulk data (sample batches, the replay buffer, counters).

The creating process owns the segments (`create`, then `close()` unlinks them); children
attach through the small picklable `SharedArraysHandle`. Segment names carry rlplex's prefix
and the creator's pid (`rlplex.io.shm_reaper`), so what a killed process left is found.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from rlplex.io.shm_reaper import owned_segment_name

Layout = Mapping[str, tuple[tuple[int, ...], Any]]  # name -> (shape, dtype)


@dataclass(frozen=True)
class SharedArraysHandle:
    arrays: tuple[tuple[str, str, tuple[int, ...], str], ...]  # (name, segment name, shape, dtype str)


class SharedArrays:
    """A dict of arrays (`.arrays`) whose memory other processes can map."""

    def __init__(self, segments: dict[str, shared_memory.SharedMemory], handle: SharedArraysHandle, owner: bool):
        self._segments = segments
        self.handle = handle
        self._owner = owner
        self.arrays: dict[str, np.ndarray] = {
            name: np.ndarray(shape, dtype=np.dtype(dtype), buffer=segments[name].buf)
            for name, _, shape, dtype in handle.arrays
        }

    @classmethod
    def create(cls, layout: Layout) -> SharedArrays:
        segments: dict[str, shared_memory.SharedMemory] = {}
        entries = []
        try:
            for name, (shape, dtype) in layout.items():
                nbytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
                segment = shared_memory.SharedMemory(owned_segment_name(), create=True, size=nbytes)
                segments[name] = segment
                entries.append((name, segment.name, tuple(int(s) for s in shape), np.dtype(dtype).str))
        except BaseException:
            for segment in segments.values():
                segment.close()
                segment.unlink()
            raise
        shared = cls(segments, SharedArraysHandle(tuple(entries)), owner=True)
        for array in shared.arrays.values():
            array.fill(0)
        return shared

    @classmethod
    def attach(cls, handle: SharedArraysHandle) -> SharedArrays:
        segments = {name: _attach_segment(segment) for name, segment, _, _ in handle.arrays}
        return cls(segments, handle, owner=False)

    def close(self) -> None:
        self.arrays = {}
        for segment in self._segments.values():
            try:
                segment.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes away with the process
            if self._owner:
                try:
                    segment.unlink()
                except FileNotFoundError:
                    pass
        self._segments = {}


def _attach_segment(name: str) -> shared_memory.SharedMemory:
    # Python < 3.13 registers even an attached segment with the resource tracker (shared by
    # all spawned children), which would unlink it when a child exits or warn on the owner's
    # unlink. Only the creating process owns the segment, so attach without registering.
    from multiprocessing import resource_tracker

    original = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = original


def allocate(layout: Layout, shared: bool) -> tuple[dict[str, np.ndarray], SharedArrays | None]:
    """Arrays for `layout`, in shared memory when asked (the owner must `close()` the second value)."""
    if shared:
        block = SharedArrays.create(layout)
        return block.arrays, block
    return {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in layout.items()}, None
