"""The master's lease is visible to other processes from the moment it is taken, and is gone
when its holder dies, however it dies."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlplex.control.job.master import MasterLock
from rlplex.errors import MasterRunningError
from timing import scaled

HOLDER = """
import sys
from pathlib import Path
from rlplex.control.job.master import MasterLock
lock = MasterLock.acquire(Path(sys.argv[1]))
print("held", flush=True)
sys.stdin.read()
"""


def test_the_lease_is_seen_while_held_and_gone_when_its_holder_is_killed(tmp_path: Path) -> None:
    assert not MasterLock.held(tmp_path)  # no lock file yet
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        # A master that has taken the lease but not yet recorded its pid counts as live.
        assert MasterLock.held(tmp_path)
        with pytest.raises(MasterRunningError, match=f"pid {holder.pid}"):
            MasterLock.acquire(tmp_path)
        holder.kill()
        holder.wait(timeout=scaled(30))
        assert not MasterLock.held(tmp_path)
        MasterLock.acquire(tmp_path).release()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=scaled(30))


def test_held_by_this_process_counts_too(tmp_path: Path) -> None:
    lock = MasterLock.acquire(tmp_path)
    try:
        assert MasterLock.held(tmp_path)
    finally:
        lock.release()
    assert not MasterLock.held(tmp_path)
