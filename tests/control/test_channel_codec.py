"""The channel codec: every array layout and dtype it accepts comes back bit for bit, in one process."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from rlplex.control.channels.base import ChannelError, decode_item, encode_item


def round_trip(item: Any) -> Any:
    encoded = encode_item(item)
    buf = memoryview(bytearray(encoded.size))
    encoded.write(buf)
    return decode_item(buf)


ARRAYS = {
    "uint8": np.arange(1000, dtype=np.uint8),
    "bool": np.array([True, False, True]),
    "float16": np.linspace(0, 1, 7, dtype=np.float16),
    "complex128": np.array([1 + 2j, -3j]),
    "big_endian": np.arange(5, dtype=">i4"),
    "zero_d": np.array(3.5),
    "empty": np.zeros((0, 4), np.float32),
    "fortran": np.asfortranarray(np.arange(12, dtype=np.int64).reshape(3, 4)),
    "strided": np.arange(40, dtype=np.float64)[::3],
    "transposed": np.arange(24, dtype=np.int16).reshape(2, 3, 4).transpose(2, 0, 1),
    "datetime": np.array(["2024-01-01", "2025-06-30"], dtype="datetime64[D]"),
}


@pytest.mark.parametrize("key", sorted(ARRAYS))
def test_arrays_round_trip_with_dtype_shape_and_values(key: str) -> None:
    array = ARRAYS[key]
    got = round_trip({"a": array})["a"]
    assert got.dtype == array.dtype and got.shape == array.shape
    assert np.array_equal(got, array)
    assert got.flags.writeable and got.flags.owndata  # a copy, not a view of the channel's memory


def test_scalars_tensors_and_nesting() -> None:
    item = {"s": np.float32(1.5), "t": torch.arange(6).reshape(2, 3).T, "nested": [b"\x00", {"x": None}]}
    got = round_trip(item)
    assert isinstance(got["s"], np.float32) and got["s"] == np.float32(1.5)
    assert torch.equal(got["t"], item["t"])
    assert got["nested"] == [b"\x00", {"x": None}]


def test_object_arrays_are_refused() -> None:
    with pytest.raises(ChannelError, match="dtype object"):
        encode_item(np.array([object()]))
