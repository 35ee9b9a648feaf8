"""Named numpy arrays over `multiprocessing.shared_memory`, for anything other than a sample
batch that processes share: the replay buffer, a model's weights, counters.

Same ownership rule as `shared.py`: the creating process owns (and unlinks) the segments,
children attach through the small picklable `SharedArraysHandle`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from rlplex.samplers.shared import _attach_segment

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
                segment = shared_memory.SharedMemory(create=True, size=nbytes)
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


def allocate(layout: Layout, shared: bool) -> tuple[dict[str, np.ndarray], SharedArrays | None]:
    """Arrays for `layout`, in shared memory when asked (the owner must `close()` the second value)."""
    if shared:
        block = SharedArrays.create(layout)
        return block.arrays, block
    return {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in layout.items()}, None
