"""Sample batches laid over shared memory, so worker processes write straight into the
arrays the learner reads (no pickling of bulk arrays through pipes).

A `SharedBatch` is a `SampleBatch` view over a `SharedArrays` block; the creating process
owns it (`create`, then `close()`), children attach through the picklable handle.
"""

from __future__ import annotations

from rlplex.envs import EnvSpaces
from rlplex.samplers.batch import InfoSpec, SampleBatch, batch_from_arrays, batch_layout
from rlplex.samplers.shared_arrays import SharedArrays, SharedArraysHandle

SharedBatchHandle = SharedArraysHandle


class SharedBatch:
    def __init__(self, block: SharedArrays) -> None:
        self._block = block
        self.handle: SharedBatchHandle = block.handle
        self.batch: SampleBatch = batch_from_arrays(block.arrays)

    @classmethod
    def create(cls, spaces: EnvSpaces, info_spec: InfoSpec, T: int, B: int) -> SharedBatch:
        return cls(SharedArrays.create(batch_layout(spaces, info_spec, T, B)))

    @classmethod
    def attach(cls, handle: SharedBatchHandle) -> SharedBatch:
        return cls(SharedArrays.attach(handle))

    def close(self) -> None:
        # Drop the numpy views first: a segment with live exported buffers cannot be closed.
        self.batch = None  # type: ignore[assignment]
        self._block.close()
