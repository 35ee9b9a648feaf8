"""A model's `state_dict` (parameters and buffers) in one shared-memory segment, with a version.

The learner writes its weights here between batches; sampler workers attach through the
small picklable `SharedWeightsHandle` and reload only when the version moved. Tensors of
any dtype sit at aligned byte offsets of one segment (so buffers such as DQN's epsilon
travel with the weights), and the version is an int64 at offset 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

from rlplex.errors import RlplexError
from rlplex.io.shm_reaper import owned_segment_name
from rlplex.samplers.shared_arrays import _attach_segment

_ALIGN = 64
_VERSION_BYTES = 8


@dataclass(frozen=True)
class SharedWeightsHandle:
    segment: str
    entries: tuple[tuple[str, int, tuple[int, ...], str], ...]  # (key, byte offset, shape, torch dtype name)


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."))
    assert isinstance(dtype, torch.dtype)
    return dtype


class SharedWeights:
    def __init__(self, segment: shared_memory.SharedMemory, handle: SharedWeightsHandle, owner: bool) -> None:
        self._segment: shared_memory.SharedMemory | None = segment
        self.handle = handle
        self._owner = owner
        self._version = torch.frombuffer(segment.buf, dtype=torch.int64, count=1, offset=0)
        self.tensors: dict[str, torch.Tensor] = {}
        for key, offset, shape, dtype_name in handle.entries:
            dtype = _torch_dtype(dtype_name)
            numel = 1
            for size in shape:
                numel *= size
            if numel == 0:
                self.tensors[key] = torch.empty(shape, dtype=dtype)
            else:
                flat = torch.frombuffer(segment.buf, dtype=dtype, count=numel, offset=offset)
                self.tensors[key] = flat.view(shape)

    @classmethod
    def create(cls, state: Mapping[str, torch.Tensor]) -> SharedWeights:
        """A segment laid out for `state` and holding it, at version 1."""
        entries = []
        offset = _ALIGN  # the version lives in the first (aligned) block
        for key, tensor in state.items():
            entries.append((key, offset, tuple(tensor.shape), str(tensor.dtype)))
            nbytes = tensor.numel() * tensor.element_size()
            offset += -(-nbytes // _ALIGN) * _ALIGN
        segment = shared_memory.SharedMemory(owned_segment_name(), create=True, size=offset)
        shared = cls(segment, SharedWeightsHandle(segment.name, tuple(entries)), owner=True)
        shared.write(state)
        shared._version[0] = 1
        return shared

    @classmethod
    def attach(cls, handle: SharedWeightsHandle) -> SharedWeights:
        return cls(_attach_segment(handle.segment), handle, owner=False)

    @property
    def version(self) -> int:
        return int(self._version[0])

    def write(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Copy `state` in where it differs; bump the version if anything changed.

        Comparing costs about as much as copying, but a skipped bump saves every worker a
        reload, and comparing contents also catches changes made through `.data`, which
        bypass tensor version counters.
        """
        if state.keys() != self.tensors.keys():
            missing = sorted(set(self.tensors) - set(state))
            extra = sorted(set(state) - set(self.tensors))
            raise RlplexError(f"shared weights: state_dict keys changed (missing {missing}, unexpected {extra})")
        changed = False
        with torch.no_grad():
            for key, value in state.items():
                target, host = self.tensors[key], value.detach().cpu()  # one copy from a GPU
                if not torch.equal(target, host):
                    target.copy_(host)
                    changed = True
        if changed:
            self._version[0] += 1
        return changed

    def close(self) -> None:
        """Release the mapping; the owner also unlinks the segment. Safe to call twice."""
        if self._segment is None:
            return
        segment, self._segment = self._segment, None
        # Drop the tensor views first: a segment with live exported buffers cannot be closed.
        self.tensors = {}
        del self._version
        try:
            segment.close()
        except BufferError:
            pass  # someone still holds a view; the mapping goes away with the process
        if self._owner:
            try:
                segment.unlink()
            except FileNotFoundError:
                pass
