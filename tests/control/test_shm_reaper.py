"""Process-owned shared memory left by killed processes: real processes, real /dev/shm files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from node_helpers import wait_for
from rlplex.control.backends.local import LocalScheduler
from rlplex.io.shm_reaper import SHM_DIR, group_pids, release, shm_in_use
from rlplex.samplers.shared_arrays import SharedArrays, SharedArraysHandle
from timing import scaled

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir() or sys.platform != "linux", reason="Linux /dev/shm only")


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def hold(started: list[subprocess.Popen[str]]) -> tuple[subprocess.Popen[str], list[str], SharedArraysHandle]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parents[1] / "src"), str(HERE)])}
    process = subprocess.Popen(
        [sys.executable, str(HERE / "shm_holder.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=env, start_new_session=True,
    )  # fmt: skip
    started.append(process)
    assert process.stdout is not None
    line = json.loads(process.stdout.readline())
    names = list(line["names"])
    handle = SharedArraysHandle(tuple((a, b, tuple(c), d) for a, b, c, d in line["handle"]))
    assert all((SHM_DIR / name).exists() for name in names)
    assert [n for n in names if n.startswith(f"rlplex-shm-{process.pid}-")] == names[:2]
    return process, names, handle


def existing(names: list[str]) -> list[str]:
    return [name for name in names if (SHM_DIR / name).exists()]


def test_a_killed_process_group_leaves_no_shared_memory(tmp_path: Path, holders: list[subprocess.Popen[str]]) -> None:
    # A bare SIGKILL of the group takes Python's resource tracker too: the names stay behind.
    process, names, _ = hold(holders)
    assert set(names) <= shm_in_use(group_pids(process.pid))
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert existing(names) == names
    assert release(names) == sorted(names) and existing(names) == []

    # The local scheduler's kill (a node's end) notes them first and unlinks what the group left,
    # but not a segment another live process (this one) still maps.
    process, names, handle = hold(holders)
    attached = SharedArrays.attach(handle)
    scheduler = LocalScheduler(tmp_path, "job", b"k" * 32)
    try:
        node = scheduler.attach("n-0", "n", 0, 0, process.pid, psutil.Process(process.pid).create_time())
        scheduler.kill(node)
    finally:
        scheduler.cleanup()
    process.wait()
    assert existing(names) == [names[0]]
    attached.close()
    assert release(names) == [names[0]] and existing(names) == []


def test_a_sigterm_leaves_no_shared_memory(holders: list[subprocess.Popen[str]]) -> None:
    process, names, _ = hold(holders)
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(timeout=scaled(30)) == -signal.SIGTERM
    wait_for(lambda: not existing(names), 10.0, f"{names} unlinked by the resource tracker")
