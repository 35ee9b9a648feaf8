"""`DataChannel`: the bounded, ordered queue between the stages of a worker self-loop.

A stage pulls an item from its source channel, processes it, and pushes the result into
its sink channel (see `rlplex.control.channels.selfloop`). Every implementation keeps the same
contract, so a job moves from local processes to Ray without touching the stage code:

- bounded: `put` blocks while the channel holds `capacity` items, up to its timeout, then
  raises `ChannelTimeoutError` naming the channel (backpressure reaches the producer);
- ordered per producer: two items put by one producer arrive in that order;
- `close()` wakes every waiter: blocked putters raise `ChannelClosedError` at once, getters
  drain what is left and then raise `ChannelClosedError`;
- items are JSON-like values (None, bool, int, float, str, list, dict with str keys), bytes,
  numpy arrays and torch tensors, nested freely. Tuples arrive as lists.

The codec here turns an item into a small msgpack header plus the raw buffers of its arrays,
so arrays travel as bytes copied straight into shared memory, never through pickle; torch is
imported only when a tensor is met.
"""

from __future__ import annotations

import re
import struct
import threading
from typing import Any, Protocol, runtime_checkable

import msgpack
import numpy as np

from rlplex.errors import RlplexError

__all__ = [
    "ChannelClosedError",
    "ChannelError",
    "ChannelTimeoutError",
    "DataChannel",
    "Encoded",
    "decode_item",
    "encode_item",
    "validate_channel_name",
]


class ChannelError(RlplexError):
    """A data channel cannot be created, attached or used; the message names the channel."""


class ChannelClosedError(ChannelError):
    """The channel is closed: nothing more may be put, and a getter found it closed and drained."""


class ChannelTimeoutError(ChannelError):
    """A `put` (channel full) or `get` (channel empty) waited past its timeout."""


@runtime_checkable
class DataChannel(Protocol):
    """A bounded FIFO between processes. Timeouts are seconds; None waits until the channel changes state."""

    @property
    def name(self) -> str: ...

    @property
    def capacity(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def put(self, item: Any, timeout: float | None = None) -> None: ...

    def get(self, timeout: float | None = None) -> Any: ...

    def get_batch(self, max_items: int, timeout: float | None = None) -> list[Any]:
        """Wait (up to `timeout`) for one item, then take up to `max_items` without waiting more."""
        ...

    def qsize(self) -> int: ...

    def close(self) -> None: ...


_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,120}$")


def validate_channel_name(name: str) -> str:
    if not _NAME.match(name):
        raise ChannelError(f"channel name {name!r} must be 1-120 characters of letters, digits, '_', '.', '-'")
    return name


# msgpack extension codes; the payload of each is struct-packed (buffer index, shape, dtype, torch dtype).
_EXT_NDARRAY = 1
_EXT_TENSOR = 2
_EXT_SCALAR = 3  # a numpy scalar (np.float32(1.0)), kept apart from a 0-d array
_ALIGN = 64
# An encoded item: u64 msgpack length, u64 array count, u64 size of each array, the msgpack
# tree, then each array's bytes at a 64-byte aligned offset.
_Q = struct.Struct("<Q")
_EXT_HEAD = struct.Struct("<IBB")  # buffer index, ndim, length of the dtype string


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _is_tensor(obj: object) -> bool:
    # Checked by module name so that a channel that never sees a tensor never imports torch.
    return type(obj).__module__.startswith("torch") and type(obj).__name__ in ("Tensor", "Parameter")


class Encoded:
    """An item split into a msgpack tree and the arrays laid after it; `size` bytes once written."""

    __slots__ = ("arrays", "offsets", "size", "tree")

    def __init__(self, tree: bytes, arrays: list[np.ndarray]):
        self.tree = tree
        self.arrays = arrays
        offset = _align(8 * (2 + len(arrays)) + len(tree))
        self.offsets = []
        for array in arrays:
            self.offsets.append(offset)
            offset = _align(offset + array.nbytes)
        self.size = offset

    def write(self, buf: memoryview) -> None:
        """Lay the item into `buf` (at least `size` bytes): one copy per array, whatever its layout."""
        arrays = self.arrays
        struct.pack_into(f"<{2 + len(arrays)}Q", buf, 0, len(self.tree), len(arrays), *(a.nbytes for a in arrays))
        start = 8 * (2 + len(arrays))
        buf[start : start + len(self.tree)] = self.tree
        for array, offset in zip(arrays, self.offsets, strict=True):
            if array.nbytes:
                _copy_into(buf, offset, array)


def _copy_into(buf: memoryview, offset: int, array: np.ndarray) -> None:
    """Copy `array`'s bytes to `buf[offset:]` in C order."""
    if array.flags.c_contiguous:
        # A plain memoryview copy: half the cost of building an ndarray over `buf` for small items.
        try:
            flat = memoryview(array).cast("B")  # type: ignore[arg-type]
        except (TypeError, ValueError, NotImplementedError):  # formats memoryview cannot export or cast
            pass
        else:
            buf[offset : offset + array.nbytes] = flat
            return
    np.copyto(np.ndarray(array.shape, array.dtype, buffer=buf, offset=offset), array, casting="no")


class _Encoder(threading.local):
    # One reusable Packer per thread: building a Packer costs more than packing a small item.
    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.packer = msgpack.Packer(default=self._default, use_bin_type=True, autoreset=True)

    def _ext(self, code: int, array: np.ndarray, torch_dtype: str = "") -> msgpack.ExtType:
        if array.dtype.hasobject or array.dtype.fields is not None or array.dtype.subdtype is not None:
            raise ChannelError(f"numpy arrays of dtype {array.dtype} cannot travel on a channel (plain dtypes only)")
        self.arrays.append(array)
        dtype = array.dtype.str.encode()
        head = _EXT_HEAD.pack(len(self.arrays) - 1, array.ndim, len(dtype))
        shape = struct.pack(f"<{array.ndim}Q", *array.shape)
        return msgpack.ExtType(code, head + shape + dtype + torch_dtype.encode())

    def _default(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return self._ext(_EXT_NDARRAY, obj)
        if isinstance(obj, np.generic):
            return self._ext(_EXT_SCALAR, np.asarray(obj))
        if _is_tensor(obj):
            import torch

            tensor = obj.detach().cpu()
            torch_dtype = str(tensor.dtype).removeprefix("torch.")
            if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: carry its bits as int16
                tensor = tensor.view(torch.int16)
            return self._ext(_EXT_TENSOR, tensor.numpy(), torch_dtype)
        raise ChannelError(f"cannot put an item of type {type(obj).__name__} on a channel")

    def encode(self, item: Any) -> Encoded:
        self.arrays = []
        try:
            tree = self.packer.pack(item)
        except (TypeError, ValueError, OverflowError) as error:  # e.g. non-str dict keys, ints past 64 bits
            self.packer.reset()
            raise ChannelError(f"cannot encode item for a channel: {error}") from error
        except BaseException:
            self.packer.reset()
            raise
        return Encoded(tree, self.arrays)


_ENCODER = _Encoder()


def encode_item(item: Any) -> Encoded:
    """Split `item` into a msgpack tree and the arrays (and tensors, as numpy views) it holds."""
    return _ENCODER.encode(item)


def decode_item(buf: memoryview) -> Any:
    """Rebuild an item from `buf`; arrays and tensors are copied out, so `buf` may be reused at once."""
    tree_len, n_arrays = _Q.unpack_from(buf, 0)[0], _Q.unpack_from(buf, 8)[0]
    sizes = struct.unpack_from(f"<{n_arrays}Q", buf, 16)
    start = 8 * (2 + n_arrays)
    offset = _align(start + tree_len)  # the arithmetic of `Encoded.__init__`
    array_offsets = []
    for size in sizes:
        array_offsets.append(offset)
        offset = _align(offset + size)

    def ext_hook(code: int, data: bytes) -> Any:
        if code not in (_EXT_NDARRAY, _EXT_TENSOR, _EXT_SCALAR):
            return msgpack.ExtType(code, data)
        index, ndim, dtype_len = _EXT_HEAD.unpack_from(data, 0)
        shape = struct.unpack_from(f"<{ndim}Q", data, _EXT_HEAD.size)
        at = _EXT_HEAD.size + 8 * ndim
        dtype = np.dtype(data[at : at + dtype_len].decode())
        count = sizes[index] // dtype.itemsize if dtype.itemsize else 0
        if count:  # frombuffer + copy costs less than an ndarray built over `buf`
            array = np.frombuffer(buf, dtype, count, array_offsets[index]).reshape(shape).copy()
        else:
            array = np.empty(shape, dtype)
        if code == _EXT_NDARRAY:
            return array
        if code == _EXT_SCALAR:
            return array[()]
        import torch

        tensor = torch.from_numpy(array)
        torch_dtype = data[at + dtype_len :].decode()
        return tensor.view(getattr(torch, torch_dtype)) if torch_dtype == "bfloat16" else tensor

    return msgpack.unpackb(buf[start : start + tree_len], ext_hook=ext_hook, raw=False, strict_map_key=True)
