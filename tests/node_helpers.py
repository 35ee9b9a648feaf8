"""Helpers for tests that start control-plane node processes (shared by tests/control and tests/dataflow)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import psutil


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


def job_processes(output_dir: Path) -> list[psutil.Process]:
    """Every process whose command line names `output_dir` (nodes and what they started)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(str(output_dir) in part for part in process.info["cmdline"] or []):
            found.append(process)
    return found
