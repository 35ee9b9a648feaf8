"""Helpers for tests that start control-plane node processes (shared by tests/control and tests/dataflow)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import psutil

from timing import wait_for

__all__ = ["job_processes", "launched_processes", "listening_sockets", "local_ray", "node_processes", "wait_for"]


def node_processes(output_dir: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "rlplex.control.node.runtime" in cmdline and str(output_dir) in cmdline:
            found.append(process)
    return found


def job_processes(output_dir: Path) -> list[psutil.Process]:
    """Every process whose command line names `output_dir` (nodes and what they started)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any(str(output_dir) in part for part in process.info["cmdline"] or []):
            found.append(process)
    return found


def launched_processes(launcher: psutil.Process) -> list[psutil.Process]:
    """What `launcher` started and what those started (ranks, samplers, copiers, workers), not
    multiprocessing's helpers: its resource tracker and fork servers. A fork server's children
    carry the server's command line; the server's differs from its parent's. [] once the
    launcher is gone."""
    try:
        children = launcher.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    cmdlines: dict[int, list[str]] = {}
    for process in [launcher, *children]:
        with contextlib.suppress(psutil.Error):
            cmdlines[process.pid] = process.cmdline()
    found = []
    for child in children:
        cmdline = cmdlines.get(child.pid)
        with contextlib.suppress(psutil.Error):
            words = set(" ".join(cmdline or []).split())
            if cmdline is None or "multiprocessing.resource_tracker" in words:
                continue
            if "multiprocessing.forkserver" in words and cmdlines.get(child.ppid()) != cmdline:
                continue
            found.append(child)
    return found


def listening_sockets(processes: list[psutil.Process]) -> list[tuple[str, str, int]]:
    """(process, address, port) of every listening TCP socket and bound UDP socket of `processes`."""
    found = []
    for process in processes:
        try:
            name = f"{process.pid} {' '.join(process.cmdline()[-3:])}"
            connections = process.net_connections("inet")
        except psutil.Error:
            continue  # it ended meanwhile
        for conn in connections:
            if conn.status == psutil.CONN_LISTEN or (conn.type == socket.SOCK_DGRAM and conn.laddr):
                found.append((name, conn.laddr.ip, conn.laddr.port))
    return found


@contextlib.contextmanager
def local_ray(*import_paths: Path | str, namespace: str | None = None) -> Iterator[str]:
    """A local Ray (num_cpus=2) whose workers import `import_paths` first (this checkout's rlplex
    and the tests' worker modules, not an installed copy); yields the GCS address."""
    import ray

    path = os.pathsep.join([*(str(p) for p in import_paths), os.environ.get("PYTHONPATH", "")])
    from rlplex.control.backends.ray import LOCAL_RAY_SYSTEM_CONFIG

    context = ray.init(
        num_cpus=2,
        include_dashboard=False,
        namespace=namespace,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
        _system_config=LOCAL_RAY_SYSTEM_CONFIG,
    )
    try:
        yield str(context.address_info["gcs_address"])
    finally:
        ray.shutdown()
