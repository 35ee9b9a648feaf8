from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.02) -> object:
    """Poll `predicate` until it returns something truthy; fail the test naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def node_processes(output_dir: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "rlplex.control.node" in cmdline and str(output_dir) in cmdline:
            found.append(process)
    return found


@pytest.fixture
def job_dir(tmp_path: Path) -> Iterator[Path]:
    """The job's output folder; afterwards, no node process of it may be left (they are killed, then fail)."""
    out = tmp_path / "job"
    try:
        yield out
    finally:
        leftovers = node_processes(out)
        _gone, alive = psutil.wait_procs(leftovers, timeout=3.0)
        for process in alive:
            os.killpg(process.pid, signal.SIGKILL)
        assert not alive, f"orphan node processes left behind: {[p.pid for p in alive]}"


@pytest.fixture
def child_env() -> dict[str, str]:
    """Environment for CLI subprocesses: this worktree's code and the test workers importable."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(HERE)])}
