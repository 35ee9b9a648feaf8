from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from node_helpers import node_processes  # noqa: E402


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
