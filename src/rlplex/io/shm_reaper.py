"""Shared memory that belongs to processes, and what is left of it when they are killed.

Three kinds of /dev/shm names belong to the processes that created them (not to a job, unlike
a `LocalDataChannel`): rlplex's own segments (`rlplex-shm-<creator pid>-<random>`: sample
batches, the replay buffer, shared weights), and what `multiprocessing` makes for any library
(`psm_*` segments, such as vLLM's message queues, and `sem.mp-*` named semaphores). Their
creators unlink them on a normal exit or an exception, and Python's resource tracker (a helper
process that ignores SIGINT and SIGTERM) unlinks them when their creators die of a signal.
A SIGKILL of a whole process group kills the tracker too, and that is how rlplex stops a node
(`LocalScheduler.kill`) and a vLLM server (`VLLMServer.stop`): so those first note the names
the group uses (`shm_in_use(group_pids(pgid))`), then `release` them once the group is gone.

Linux only (/proc); elsewhere nothing is found and nothing is released.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from pathlib import Path

SHM_DIR = Path("/dev/shm")
OWNED_PREFIX = "rlplex-shm-"
PROCESS_OWNED = (OWNED_PREFIX, "psm_", "sem.mp-")
_SHM_PATH = f"{SHM_DIR}/"


def owned_segment_name() -> str:
    """A name for a segment this process creates (`SharedMemory(name=...)`): rlplex's prefix and
    the creator's pid, so that a leak check or a cleanup can tell whose it is."""
    return f"{OWNED_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"


def _all_pids() -> list[int]:
    try:
        return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return []


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group `pgid`, orphans included (a tree walk would miss them)."""
    found = []
    for pid in _all_pids():
        try:
            if os.getpgid(pid) == pgid:
                found.append(pid)
        except OSError:
            continue
    return found


def _inodes_in_use(pids: Iterable[int]) -> set[int]:
    """Inodes of /dev/shm files that `pids` map or hold open. By inode, not by the path /proc shows:
    glibc creates a named semaphore under a temporary name, maps it, then renames it by a link."""
    inodes: set[int] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6 and fields[5].startswith(_SHM_PATH):
                        inodes.add(int(fields[4]))
            fd_dir = f"/proc/{pid}/fd"
            for fd in os.listdir(fd_dir):
                try:
                    if os.readlink(f"{fd_dir}/{fd}").startswith(_SHM_PATH):
                        inodes.add(os.stat(f"{fd_dir}/{fd}").st_ino)
                except OSError:
                    continue
        except OSError:  # gone, or another user's
            continue
    return inodes


def shm_in_use(pids: Iterable[int] | None = None) -> set[str]:
    """Process-owned /dev/shm names that `pids` (default: every process we may inspect) map or hold open."""
    inodes = _inodes_in_use(_all_pids() if pids is None else pids)
    if not inodes:
        return set()
    try:
        with os.scandir(SHM_DIR) as entries:
            return {entry.name for entry in entries if entry.name.startswith(PROCESS_OWNED) and entry.inode() in inodes}
    except OSError:
        return set()


def release(names: Iterable[str]) -> list[str]:
    """Unlink those of `names` that still exist and that no live process uses; return them.

    A name still mapped elsewhere stays (a process outside the killed group attached to it)."""
    left = {name for name in names if name.startswith(PROCESS_OWNED) and (SHM_DIR / name).exists()}
    if not left:
        return []
    removed = sorted(left - shm_in_use())
    for name in removed:
        (SHM_DIR / name).unlink(missing_ok=True)
    return removed
