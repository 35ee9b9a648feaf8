"""Steps 1 to 5 of `discover_runs()`: `RunScanner` scans `output_dir` for `run_*` and sets
evicted and finished runs aside (steps 1 and 2); `RunLedger` keeps the master's book of the
runs without a slot: identities, statuses and reasons, the waiting queue (steps 3 to 5).

One `os.scandir` per scan gives the entry types without a stat per entry; an entry is
checked (name, symlink, directory) the first time it is seen and warned about once, so a
steady-state scan of 1,000 runs costs one directory read plus two `exists` per run (for
`control/evicted.txt` and `control/finished.txt`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rlplex.errors import MultiRunError, RunConfigError, RunDirGoneError
from rlplex.multirun.orchestrator.config import OrchestratorConfig, read_orch_config
from rlplex.multirun.rundir import (
    RUN_PREFIX,
    RunDir,
    is_valid_run_name,
    read_unwritten_evictions,
    remove_unwritten_eviction,
    run_folder_problem,
    write_eviction,
)

log = logging.getLogger(__name__)

RunStatus = Literal["active", "waiting", "rejected", "pending", "evicted", "finished"]
CLOSED_STATUSES: tuple[RunStatus, ...] = ("evicted", "finished")
"""Statuses a run keeps until its marker file goes away; such a run never holds a slot."""

Signature = tuple[int, int, int]


def signature_of(path: Path) -> Signature | None:
    """What tells a rewritten file from the one a decision was taken on."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_mtime_ns, info.st_size, info.st_ino)


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
            problem = run_folder_problem(entry)
            if problem is not None:
                self._ignore(name, problem, result)
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


class RunLedger:
    """Steps 3 to 5 of `discover_runs()`, the master's book of every run directory without a
    slot: who each run is (its inode and identity), its status and why, the waiting runs with
    the config they were judged on, and the evictions whose marker could not be written. The
    manager owns the slots and asks the ledger which runs wait; the ledger judges a run's
    `orch.toml` with `validate` (the manager's: LoRA rank, validation hooks)."""

    def __init__(self, output_dir: Path, validate: Callable[[OrchestratorConfig, RunDir], None], master: bool) -> None:
        self.output_dir = output_dir
        self.validate = validate
        self.status: dict[str, RunStatus] = {}
        self.reasons: dict[str, str] = {}
        self.waiting: dict[str, tuple[Signature | None, OrchestratorConfig]] = {}
        self.unadmitted: dict[str, Signature | None] = {}
        """rejected or pending runs and the orch.toml signature they were judged on."""
        self.inodes: dict[str, int] = {}
        self.identities: dict[str, str | None] = {}
        self.active_signatures: dict[str, Signature | None] = {}
        """orch.toml signature of each active run when it was admitted (its config is frozen)."""
        self.master = master
        self.unwritten: dict[str, tuple[str | None, str]] = read_unwritten_evictions(output_dir) if master else {}
        """Evictions recorded beside the runs (their folder refused the marker; an orchestrator's
        too, read again at every scan): run id -> (identity, reason)."""
        self.unrecorded: dict[str, tuple[str | None, str]] = {}
        """Evictions that could be written nowhere: kept for this trainer's life."""

    def run_dir(self, run_id: str) -> RunDir:
        return RunDir(self.output_dir, run_id, self.identities.get(run_id))

    def is_closed(self, run_id: str) -> bool:
        return self.status.get(run_id) in CLOSED_STATUSES

    def replaced(self, inodes: dict[str, int]) -> set[str]:
        """Names whose directory is not the run known under that name (another inode or identity)."""
        replaced = {name for name, inode in inodes.items() if self.inodes.get(name, inode) != inode}
        self.inodes = inodes
        identities: dict[str, str | None] = {}
        for name in inodes:
            run = RunDir(self.output_dir, name)
            identity = run.read_identity()
            if name in self.identities and self.identities[name] != identity:
                replaced.add(name)
            if identity is None:
                try:
                    identity = run.ensure_identity()  # made by hand or by an older rlplex
                except (OSError, RunDirGoneError, MultiRunError) as error:
                    log.warning("run %s: no identity and none could be written (%s)", name, error)
            identities[name] = identity
        self.identities = identities
        for name in replaced:
            log.warning("run %s: the directory was replaced by a new run of the same name", name)
        # Deleted, or a new run under that name: the recorded eviction is not its own.
        self.unwritten = read_unwritten_evictions(self.output_dir) if self.master else {}
        for table, on_disk in ((self.unwritten, True), (self.unrecorded, False)):
            for name, (identity, _) in list(table.items()):
                if identities.get(name, identity) != identity or name not in inodes:
                    del table[name]
                    if on_disk:
                        remove_unwritten_eviction(self.output_dir, name)
        return replaced

    def evicted_elsewhere(self) -> set[str]:
        """Runs evicted although their folder holds no marker (it refused it)."""
        return set(self.unwritten) | set(self.unrecorded)

    def update_unslotted(self, live: set[str], closed: dict[str, RunStatus], slots: dict[str, int]) -> None:
        """Statuses after a scan; `slots`: the slot of each run that holds one (for the log)."""
        for name, status in list(self.status.items()):
            if closed.get(name) == status or (name in live and status not in CLOSED_STATUSES):
                continue
            # Deleted, newly closed, or its evicted.txt / finished.txt was removed (then judged anew).
            self.forget(name)
        for name, status in closed.items():
            self.waiting.pop(name, None)
            self.unadmitted.pop(name, None)
            if self.status.get(name) != status:
                self.status[name] = status
                self.reasons[name] = self.closed_reason(name, status)
                slot = slots.get(name)
                freed = "" if slot is None else f"; slot {slot} frees"
                log.info("run %s is %s (%s)%s", name, status, self.reasons[name], freed)

    def closed_reason(self, name: str, status: RunStatus) -> str:
        run = self.run_dir(name)
        if status == "evicted":
            return run.eviction_reason() or "evicted"
        step = run.finished_step()
        return f"finished: trained {step} steps" if step is not None else f"finished ({run.finished} unreadable)"

    def forget(self, name: str) -> None:
        for table in (self.status, self.waiting, self.unadmitted, self.reasons, self.active_signatures):
            table.pop(name, None)

    def judge(self, names: list[str]) -> None:
        """Step 5: load and validate; sort each run into waiting, rejected or pending."""
        for name in names:
            run = self.run_dir(name)
            signature = signature_of(run.orch_config)
            self.waiting.pop(name, None)
            if signature is None and not os.path.lexists(run.orch_config):
                self.status[name] = "pending"
                self.reasons[name] = f"{run.orch_config} not written yet"
                self.unadmitted[name] = None
                continue
            try:
                config = read_orch_config(run.orch_config, within=run.root)
                self.validate(config, run)
            except RunConfigError as error:
                self.reject(run, signature, str(error))
                continue
            self.unadmitted.pop(name, None)
            self.reasons.pop(name, None)
            self.status[name] = "waiting"
            self.waiting[name] = (signature, config)
            if os.path.lexists(run.config_error):
                run.remove_file(run.config_error)

    def reject(self, run: RunDir, signature: Signature | None, reason: str) -> None:
        name = run.run_id
        self.status[name] = "rejected"
        self.reasons[name] = reason
        self.unadmitted[name] = signature
        log.warning("run %s rejected: %s", name, reason)
        try:
            run.write_text(run.config_error, reason + "\n")
        except (OSError, RunDirGoneError, MultiRunError) as error:
            log.error("run %s: could not write %s: %s", name, run.config_error, error)

    def close_as_evicted(self, run_id: str, reason: str) -> None:
        """Write the run's eviction (see `write_eviction`); if it can be written nowhere, keep it evicted anyway."""
        run = self.run_dir(run_id)
        try:
            write_eviction(run, reason)
        except RunDirGoneError:
            log.warning("run %s to be evicted is already deleted or replaced", run_id)
        except (OSError, MultiRunError) as error:
            log.error(
                "run %s: evicted, but its marker could be written neither in nor beside its folder: %s", run_id, error
            )
            self.unrecorded[run_id] = (self.identities.get(run_id), f"{reason} ({run.evicted} not written: {error})")
        else:
            if not run.is_evicted():
                log.error("run %s: evicted, its marker recorded beside its folder, which refused it", run_id)
        self.waiting.pop(run_id, None)
        self.unadmitted.pop(run_id, None)
        self.status[run_id] = "evicted"
        self.reasons[run_id] = reason
