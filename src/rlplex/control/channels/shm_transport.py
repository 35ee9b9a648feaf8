"""Items in /dev/shm files: how encoded arrays and tensors cross processes without pickle.

An item encoded by `rlplex.control.channels.base.encode_item` (a msgpack tree and the raw bytes of
its arrays) is laid straight into a memory-mapped file, one memcpy per array, and decoded
from the mapping on the other side. Files are created 0600 with every page reserved up
front, so a full /dev/shm fails at creation with an error rather than as a SIGBUS mid-copy.
Linux only.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

from rlplex.control.channels.base import Encoded, decode_item

__all__ = ["SHM_DIR", "create_reserved", "read_segment", "unlink_matching", "write_segment"]

SHM_DIR = Path("/dev/shm")


def create_reserved(path: Path, size: int) -> int:
    """Create `path` (it must not exist) with `size` bytes reserved; return its open descriptor.

    Raises FileExistsError when `path` exists, and OSError (with `path` removed again) when
    shared memory cannot hold `size` bytes.
    """
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    return fd


def write_segment(path: Path, encoded: Encoded) -> None:
    """Write `encoded` into a new file at `path`, sized to the item; OSError leaves no file."""
    fd = create_reserved(path, encoded.size)
    try:
        with mmap.mmap(fd, encoded.size) as segment, memoryview(segment) as view:
            encoded.write(view)
    except OSError:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def read_segment(path: Path) -> Any:
    """Decode the item in the file at `path`, then remove the file (read once, even on error)."""
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as segment:
            with memoryview(segment) as view:
                return decode_item(view)
    finally:
        path.unlink(missing_ok=True)


def unlink_matching(pattern: str) -> list[str]:
    """Remove the files of SHM_DIR matching the glob `pattern`; return their names."""
    removed = []
    for path in SHM_DIR.glob(pattern):
        path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed
