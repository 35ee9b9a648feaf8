"""A small tmpfs mounted over a folder: a real disk that a test fills, frees or makes read-only.

Mounting needs root with CAP_SYS_ADMIN (these machines' containers have it); elsewhere the
tests that use it are skipped with the reason.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

_FILLER = ".filler"


class SmallDisk:
    def __init__(self, path: Path) -> None:
        self.path = path

    def fill(self) -> None:
        """Take every free byte: the next write of anything into the folder fails with ENOSPC."""
        fd = os.open(self.path / _FILLER, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in (65536, 4096, 1):
                try:
                    while True:
                        os.write(fd, b"\0" * size)
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
        finally:
            os.close(fd)

    def free(self) -> None:
        os.unlink(self.path / _FILLER)

    def read_only(self, on: bool = True) -> None:
        _mount(["-o", f"remount,{'ro' if on else 'rw'}", str(self.path)])


def _mount(args: list[str]) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


@contextmanager
def small_disk(path: Path, size_kb: int = 2048) -> Iterator[SmallDisk]:
    """A `size_kb` tmpfs over `path` (a folder), holding what `path` held; unmounted at the end,
    its files copied back so that the test's assertions and pytest's clean-up find them."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs (a disk the test can fill)")
    aside = Path(tempfile.mkdtemp(prefix="small-disk-"))
    shutil.copytree(path, aside, dirs_exist_ok=True, symlinks=True)
    try:
        _mount(["-t", "tmpfs", "-o", f"size={size_kb}k,mode=0755", "tmpfs", str(path)])
    except subprocess.CalledProcessError as error:
        shutil.rmtree(aside)
        pytest.skip(f"cannot mount a tmpfs here: {error.stderr.strip()}")
    try:
        shutil.copytree(aside, path, dirs_exist_ok=True, symlinks=True)
        yield SmallDisk(path)
    finally:
        held = Path(tempfile.mkdtemp(prefix="small-disk-held-"))
        shutil.copytree(path, held, dirs_exist_ok=True, symlinks=True, ignore=shutil.ignore_patterns(_FILLER))
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)
        shutil.copytree(held, path, dirs_exist_ok=True, symlinks=True)
        shutil.rmtree(held, ignore_errors=True)
        shutil.rmtree(aside, ignore_errors=True)
