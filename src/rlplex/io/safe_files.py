"""Reading files that other processes or users can put anything at: one helper for all of them.

A run folder, a job folder or a path on the command line may hold a FIFO (opening it blocks
until a writer comes), a symlink to `/dev/zero` (reading never ends) or a link out of the
folder. Every such read goes through `read_regular_file`, which opens without following a
final symlink and without blocking, checks on the open descriptor that it is a regular file
within a size cap, and reads at most one byte past the cap (the file may grow meanwhile).
`check_regular_file` is the same check for readers that must open the path themselves
(safetensors' memory-mapped loader).

Writes into such folders never go through a link either: `write_file_atomic` creates its
temporary exclusively (a planted link or hard link at that name is removed, never written
through), `append_regular_file` appends only to a regular file of its own, and `make_real_dir`
refuses a folder that is a symlink.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from rlplex.errors import ConfigError, RunDirGoneError, UnsafeFileError

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

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
        fd = os.open(path, os.O_RDONLY | nofollow | os.O_NONBLOCK | _CLOEXEC)
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


def _create_exclusive(path: Path) -> int:
    # O_EXCL: the file is new, so writing it cannot reach another file through a symlink or a
    # hard link someone put at this name (O_TRUNC on a hard link would rewrite the other name's
    # file). A name already there is a dead writer's leftover or planted: unlink removes the name
    # only, never what it points to.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
    try:
        return os.open(path, flags, 0o644)
    except FileExistsError:
        os.unlink(path)
    return os.open(path, flags, 0o644)


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write `data` to a new temporary sibling, fsync, rename over `path`; never write through a link.

    The rename replaces a symlink at `path` itself, not the file it points to."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = _create_exclusive(tmp)
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


def append_regular_file(path: str | os.PathLike[str], data: bytes, header: bytes = b"") -> None:
    """Append `data` to `path`, made if missing (`header` first while the file is empty).

    Only to a regular file with no other name: a symlink, a FIFO, a device or a hard link to
    another file (another run's log, say) raises `UnsafeFileError` naming `path`, and nothing is
    written. `FileNotFoundError` when the folder is gone (it is never made here).
    """
    path = Path(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as error:
        if isinstance(error, FileNotFoundError):
            raise
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            raise error from None
        if stat.S_ISLNK(mode):
            raise UnsafeFileError(f"{path}: is a symlink; nothing written through it") from None
        if not stat.S_ISREG(mode):  # a FIFO without a reader: ENXIO
            raise UnsafeFileError(f"{path}: not a regular file (mode {stat.filemode(mode)}); not written") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFileError(f"{path}: not a regular file (mode {stat.filemode(info.st_mode)}); not written")
        if info.st_nlink > 1:
            raise UnsafeFileError(f"{path}: has {info.st_nlink} hard links (it is also another file); not written")
        view = memoryview(header + data if info.st_size == 0 else data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def make_real_dir(path: Path) -> Path:
    """Make the folder `path` (one level: never its parents) or take the one there; return it.

    Raises `UnsafeFileError` naming `path` when it is a symlink (writes below it would land
    wherever it points) or not a folder, and `FileNotFoundError` when its parent is gone.
    """
    try:
        os.mkdir(path)
    except FileExistsError:
        pass
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        raise UnsafeFileError(f"{path}: is a symlink; rlplex writes nothing through a link (remove it)")
    if not stat.S_ISDIR(mode):
        raise UnsafeFileError(f"{path}: exists but is not a folder; nothing written into it")
    return path


def fsync_dir(path: Path) -> None:
    """Make the entries of directory `path` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
