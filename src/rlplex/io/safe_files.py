"""Reading files that other processes or users can put anything at: one helper for all of them.

A run folder, a job folder or a path on the command line may hold a FIFO (opening it blocks
until a writer comes), a symlink to `/dev/zero` (reading never ends) or a link out of the
folder. Every such read goes through `read_regular_file`, which opens without following a
final symlink and without blocking, checks on the open descriptor that it is a regular file
within a size cap, and reads at most one byte past the cap (the file may grow meanwhile).
`check_regular_file` is the same check for readers that must open the path themselves
(safetensors' memory-mapped loader).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from rlplex.errors import ConfigError, RunDirGoneError, UnsafeFileError

SMALL_FILE_BYTES = 1 << 20
"""Cap of control files (markers, reasons, JSON records, configs)."""

# A name that becomes a path component (run ids, job names, role and node names): a slash, a NUL
# or only dots cannot reach scandir, but such a name can reach an API that joins user names into
# paths ("../../x"); refuse anything odd outright.
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,200}$")
SAFE_NAME_RULE = "letters, digits, '_', '.', '-', starting with a letter or digit, no '..', at most 201 characters"


def is_safe_name(name: str) -> bool:
    """True when `name` can be used as one path component under a folder of ours."""
    return bool(_SAFE_NAME.fullmatch(name)) and ".." not in name


def _check_within(path: Path, within: Path | None) -> None:
    if within is None:
        return
    # The parent's real location: a symlinked step folder must not lead the reader out of the run.
    real_parent = os.path.realpath(path.parent)
    root = os.path.realpath(within)
    if real_parent != root and not real_parent.startswith(root + os.sep):
        raise UnsafeFileError(f"{path}: its folder resolves to {real_parent}, outside {root}; not read")


def _check_mode(path: Path, info: os.stat_result, max_bytes: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeFileError(f"{path}: not a regular file (mode {stat.filemode(info.st_mode)}); not read")
    if info.st_size > max_bytes:
        raise UnsafeFileError(f"{path}: {info.st_size} bytes, more than the limit of {max_bytes}; not read")


def read_regular_file(
    path: str | os.PathLike[str],
    max_bytes: int = SMALL_FILE_BYTES,
    within: Path | None = None,
    *,
    follow_symlinks: bool = False,
) -> bytes:
    """The bytes of `path`, a regular file of at most `max_bytes` (inside `within` when given).

    `follow_symlinks`: for paths a user typed (a linked config is fine there); the target must
    still be a regular file. Raises `FileNotFoundError` when it does not exist and `UnsafeFileError` (an `OSError`) when
    it is a symlink, a FIFO, a device, a folder, too big, or reached through a folder outside
    `within`.
    """
    path = Path(path)
    _check_within(path, within)
    try:
        nofollow = 0 if follow_symlinks else os.O_NOFOLLOW
        fd = os.open(path, os.O_RDONLY | nofollow | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        if isinstance(error, FileNotFoundError):
            raise
        if not follow_symlinks and os.path.islink(path):
            raise UnsafeFileError(f"{path}: is a symlink; not read") from None
        raise
    try:
        _check_mode(path, os.fstat(fd), max_bytes)
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > max_bytes:
        raise UnsafeFileError(f"{path}: grew past the limit of {max_bytes} bytes while being read; not read")
    return b"".join(chunks)


def read_regular_text(
    path: str | os.PathLike[str], max_bytes: int = SMALL_FILE_BYTES, within: Path | None = None
) -> str:
    """`read_regular_file` decoded as UTF-8 (undecodable bytes replaced: these are messages)."""
    return read_regular_file(path, max_bytes, within).decode("utf-8", errors="replace")


def check_regular_file(path: str | os.PathLike[str], max_bytes: int, within: Path | None = None) -> int:
    """Raise unless `path` is a regular file (not a symlink) of at most `max_bytes`; return its size."""
    path = Path(path)
    _check_within(path, within)
    info = os.lstat(path)
    _check_mode(path, info, max_bytes)
    return info.st_size


def ensure_output_dir(path: Path, what: str) -> Path:
    """Make `path` a folder rlplex can write into, or raise a one-line `ConfigError` naming
    it and `what` (the field or flag that named it): a file there, or a folder that is not
    writable, would otherwise fail deep inside a run with a traceback."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        # A real write: os.access says yes to root on a read-only file system.
        probe = path / f".rlplex-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        reason = error.strerror or str(error)
        if os.path.exists(path) and not os.path.isdir(path):
            reason = "it is a file, not a folder"
        raise ConfigError(f"{path}: cannot be the output folder ({what}): {reason}") from None
    return path


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write `data` to a temporary sibling, fsync, rename over `path`; never follow a symlink."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    except FileNotFoundError:
        raise RunDirGoneError(f"{path.parent}: directory was deleted; {path.name} not written") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)  # the rename itself must survive a power cut
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
