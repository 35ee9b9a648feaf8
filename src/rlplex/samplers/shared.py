"""Sample batches laid over `multiprocessing.shared_memory`, so worker processes write
straight into the arrays the learner reads (no pickling of bulk arrays through pipes).

The creating process owns the segments (`SharedBatch.create`, then `close(unlink=True)`);
children attach through the small picklable `SharedBatchHandle`.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from rlplex.envs import EnvSpaces
from rlplex.samplers.batch import InfoSpec, SampleBatch, batch_from_arrays, batch_layout


@dataclass(frozen=True)
class SharedBatchHandle:
    """Picklable description of a shared batch: segment name, shape and dtype per array."""

    arrays: tuple[tuple[str, str, tuple[int, ...], str], ...]  # (key, segment name, shape, dtype str)


class SharedBatch:
    def __init__(self, segments: dict[str, shared_memory.SharedMemory], handle: SharedBatchHandle, owner: bool):
        self._segments = segments
        self.handle = handle
        self._owner = owner
        arrays = {
            key: np.ndarray(shape, dtype=np.dtype(dtype), buffer=segments[key].buf)
            for key, _, shape, dtype in handle.arrays
        }
        self.batch: SampleBatch = batch_from_arrays(arrays)

    @classmethod
    def create(cls, spaces: EnvSpaces, info_spec: InfoSpec, T: int, B: int) -> SharedBatch:
        segments: dict[str, shared_memory.SharedMemory] = {}
        entries = []
        try:
            for key, (shape, dtype) in batch_layout(spaces, info_spec, T, B).items():
                nbytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
                segment = shared_memory.SharedMemory(create=True, size=nbytes)
                segments[key] = segment
                entries.append((key, segment.name, tuple(shape), np.dtype(dtype).str))
        except BaseException:
            for segment in segments.values():
                segment.close()
                segment.unlink()
            raise
        shared = cls(segments, SharedBatchHandle(tuple(entries)), owner=True)
        for _, array in shared.batch.arrays():
            array.fill(0)
        return shared

    @classmethod
    def attach(cls, handle: SharedBatchHandle) -> SharedBatch:
        segments = {key: _attach_segment(name) for key, name, _, _ in handle.arrays}
        return cls(segments, handle, owner=False)

    def close(self) -> None:
        # Drop the numpy views first: a segment with live exported buffers cannot be closed.
        self.batch = None  # type: ignore[assignment]
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


def attach_arrays(handle: SharedBatchHandle) -> tuple[SampleBatch, Any]:
    """Attach in a child; returns the batch view and an object to keep alive while using it."""
    shared = SharedBatch.attach(handle)
    return shared.batch, shared
