"""Steps 1 and 2 of `discover_runs()`: scan `output_dir` for `run_*` and set evicted and
finished runs aside.

One `os.scandir` per scan gives the entry types without a stat per entry; an entry is
checked (name, symlink, directory) the first time it is seen and warned about once, so a
steady-state scan of 1,000 runs costs one directory read plus two `exists` per run (for
`control/evicted.txt` and `control/finished.txt`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from rlplex.multirun.rundir import RUN_PREFIX, is_valid_run_name

log = logging.getLogger(__name__)


@dataclass
class ScanResult:
    live: list[str] = field(default_factory=list)
    """Valid run directories without `control/evicted.txt` or `control/finished.txt`, sorted by name."""
    evicted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    """Runs with `control/finished.txt` (and no `evicted.txt`: an eviction is reported first)."""
    inodes: dict[str, int] = field(default_factory=dict)
    """Inode of each live, evicted or finished run directory: a directory deleted and made again under the
    same name is a new run, not the old one carrying on."""
    ignored: list[str] = field(default_factory=list)
    """`run_*` entries that are not plain directories with a safe name."""


class RunScanner:
    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        self._checked: set[str] = set()
        self._warned: set[str] = set()

    def _ignore(self, name: str, why: str, result: ScanResult) -> None:
        result.ignored.append(name)
        if name not in self._warned:
            self._warned.add(name)
            log.warning("ignoring %s: %s", self.output_dir / name, why)

    def scan(self) -> ScanResult:
        result = ScanResult()
        try:
            entries = list(os.scandir(self.output_dir))
        except FileNotFoundError:
            return result
        seen = set()
        for entry in entries:
            name = entry.name
            if not name.startswith(RUN_PREFIX):
                continue
            seen.add(name)
            # The type comes from the directory read (d_type); no extra syscall on most filesystems.
            if entry.is_symlink():
                self._ignore(name, "it is a symlink (a run directory must live inside output_dir)", result)
                continue
            if not entry.is_dir(follow_symlinks=False):
                self._ignore(name, "it is not a directory", result)
                continue
            if name not in self._checked:
                if not is_valid_run_name(name):
                    self._ignore(name, "its name is not run_<letters, digits, _ . -> (could escape)", result)
                    continue
                self._checked.add(name)
            result.inodes[name] = entry.inode()
            if os.path.exists(f"{entry.path}/control/evicted.txt"):
                result.evicted.append(name)
            elif os.path.exists(f"{entry.path}/control/finished.txt"):
                result.finished.append(name)
            else:
                result.live.append(name)
        # Forget names that disappeared so a later entry of the same name is checked afresh.
        self._checked &= seen
        self._warned &= seen
        result.live.sort()
        result.evicted.sort()
        result.finished.sort()
        return result
