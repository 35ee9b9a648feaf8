"""Memory of process trees, read from outside (psutil): what a benchmark that starts commands
samples. No torch here: a benchmark that imported it would add its own pages to the figures."""

from __future__ import annotations

import psutil


def tree_pss_mb(pid: int) -> float:
    """The PSS of process `pid` and its descendants now (0 for those that ended meanwhile)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0
    for process in processes:
        try:
            total += process.memory_full_info().pss
        except psutil.Error:
            continue
    return total / 2**20
