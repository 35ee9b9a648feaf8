"""Retention: which `step_N` folders of a run stay on disk, and removal of crash leftovers.

Every run writes a folder per step into `checkpoints/`, `broadcast/` and `rollouts/` (see
`rundir`), so without pruning a long run fills the disk. Two rules shape everything here:

* Retention must never stop the trainer: a folder that cannot be removed (permissions, a
  concurrent deletion) is logged and skipped, and a later call tries again.
* Removal must never make a reader see half a folder: the STABLE marker goes first, so a crash
  half-way leaves an unmarked folder, which readers ignore and the next prune removes.

Only names the protocol itself writes are touched (`step_<N>` with N in canonical decimal,
`.<name>.tmp-<pid>`, `.<name>.old-<pid>`), and symlinks are unlinked, never followed, so a run
directory cannot steer a deletion outside itself.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import stat
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from rlplex.config import StrictModel
from rlplex.multirun.rundir import STABLE_MARKER

log = logging.getLogger(__name__)

# Canonical names only: `rundir.parse_step` also accepts "step_007" and non-ASCII digits, which
# the protocol never writes; whatever they are, they are not ours to delete.
_STEP_NAME = re.compile(r"step_(0|[1-9][0-9]*)", re.ASCII)
# `write_file_atomic`, `save_checkpoint`, `write_peft_adapter` and `write_snapshot` all name
# their temporaries `.<final name>.tmp-<pid>` (and the replaced folder `.<final name>.old-<pid>`).
_TEMP_NAME = re.compile(r"\.(?P<target>.+)\.(?P<kind>tmp|old)-(?P<pid>[0-9]+)", re.ASCII | re.DOTALL)
_TEMP_FOLDERS = ("checkpoints", "broadcast", "rollouts", "control")


class KeepPolicy(StrictModel):
    """Which stable steps of one kind of folder survive a prune (both unset: keep every step)."""

    keep_last: int | None = Field(
        None, ge=1, description="keep the newest N stable steps and remove older ones; None keeps every step"
    )
    keep_every: int | None = Field(
        None,
        ge=1,
        description="also keep every stable step that is a multiple of N (milestones); None keeps no extra steps",
    )


class RetentionConfig(StrictModel):
    """Retention per kind of step folder in a run directory."""

    checkpoints: KeepPolicy = Field(
        KeepPolicy(keep_last=3),
        description="`checkpoints/step_N`: a few, since resuming only needs the newest stable one",
    )
    broadcast: KeepPolicy = Field(
        KeepPolicy(keep_last=8),
        description="`broadcast/step_N` adapters: enough for inference still loading a slightly older policy",
    )
    rollouts: KeepPolicy = Field(
        KeepPolicy(keep_last=8),
        description="`rollouts/step_N`: pruned among consumed steps only (the trainer passes `prune_steps(below=...)`)",
    )


@dataclass(frozen=True, order=True)
class _StepFolder:
    step: int
    path: Path
    stable: bool  # a real directory that carries the marker
    is_link: bool


def steps_to_keep(stable: Iterable[int], policy: KeepPolicy) -> set[int]:
    """The stable steps `policy` keeps, the newest always among them."""
    ordered = sorted(set(stable))
    if not ordered or policy.keep_last is None:
        return set(ordered)
    keep = set(ordered[-policy.keep_last :])
    if policy.keep_every is not None:
        keep.update(step for step in ordered if step % policy.keep_every == 0)
    return keep


def prune_steps(
    parent: Path, policy: KeepPolicy, *, protect: Collection[int] = (), below: int | None = None
) -> list[int]:
    """Remove the `step_N` folders under `parent` that `policy` does not keep; return their steps.

    Never removed: the newest stable step, steps in `protect`, steps >= `below` (for rollouts:
    the steps the trainer has not consumed yet), unmarked folders newer than the newest stable
    step (writes in progress), and anything that is not a directory or symlink named `step_N`.
    Unmarked folders (and `step_N` symlinks, which readers ignore) older than the newest stable
    step are leftovers of failed writes and go whatever the policy. Never raises.
    """
    if not _is_real_dir(parent):
        return []  # not written yet, or a symlink that could point anywhere
    folders = _step_folders(parent)
    stable = [folder.step for folder in folders if folder.stable]
    newest = max(stable, default=None)
    keep = steps_to_keep(stable, policy)
    removed = []
    for folder in sorted(folders):
        if folder.step in protect or (below is not None and folder.step >= below):
            continue
        doomed = folder.step not in keep if folder.stable else newest is not None and folder.step < newest
        if doomed and _remove_step_folder(folder):
            removed.append(folder.step)
    return removed


def remove_orphaned_temporaries(run_root: Path, folders: Iterable[str] = _TEMP_FOLDERS) -> list[Path]:
    """Remove temporaries whose writer died, from the run's step and control folders; return them.

    Looks in `folders` (by default `checkpoints/`, `broadcast/`, `rollouts/`, `control/`) and
    one level inside their `step_N` folders. A pid is only meaningful on the machine (and pid
    namespace) that wrote it: the trainer passes the folders it writes itself. A temporary of
    a live process (this one included) is a write in progress and stays. A `.old-<pid>` folder
    stays when nothing has its final name: the writer died between its two renames and this is
    the only copy. Never raises.
    """
    removed: list[Path] = []
    if not _is_real_dir(run_root):
        return removed
    for name in folders:
        folder = run_root / name
        if not _is_real_dir(folder):
            continue
        entries = _scan(folder)
        for entry in entries:
            if _STEP_NAME.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                removed.extend(_remove_orphans_in(Path(entry.path), _scan(Path(entry.path))))
        removed.extend(_remove_orphans_in(folder, entries))
    return removed


def pid_is_live(pid: int) -> bool:
    """Whether `pid` may be a running process (this one is); anything uncertain counts as live."""
    if pid <= 0:
        return True  # 0 would probe our own process group, not a writer
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True  # EPERM: alive under another user; an impossible pid: not ours to judge
    return True


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _scan(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except OSError as error:
        log.warning("retention: cannot list %s: %s", folder, error)
        return []


def _step_folders(parent: Path) -> list[_StepFolder]:
    folders = []
    for entry in _scan(parent):
        match = _STEP_NAME.fullmatch(entry.name)
        if match is None:
            continue
        path = Path(entry.path)
        try:
            is_link = entry.is_symlink()
            is_dir = not is_link and entry.is_dir(follow_symlinks=False)
            # Same test as `rundir.stable_steps`, so "stable" means what readers take as stable.
            stable = is_dir and os.path.exists(path / STABLE_MARKER)
        except OSError:
            continue
        if is_link or is_dir:
            folders.append(_StepFolder(int(match.group(1)), path, stable, is_link))
    return folders


def _remove_step_folder(folder: _StepFolder) -> bool:
    try:
        if folder.is_link:
            os.unlink(folder.path)
        else:
            _unmark(folder.path)
            shutil.rmtree(folder.path)
    except OSError as error:
        # A vanished folder is the normal outcome of a run deleted meanwhile, not a fault.
        level = logging.INFO if error.errno == errno.ENOENT else logging.WARNING
        log.log(level, "retention: %s not removed (a later prune retries): %s", folder.path, error)
        return False
    log.info("retention: removed %s", folder.path)
    return True


def _unmark(path: Path) -> None:
    # Through a descriptor opened without following links: had `path` been swapped for a
    # symlink since the scan, unlinking `path / STABLE` would delete a file outside the run.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.unlink(STABLE_MARKER, dir_fd=fd)
    except FileNotFoundError:
        pass  # an unmarked leftover
    finally:
        os.close(fd)


def _remove_orphans_in(folder: Path, entries: Iterable[os.DirEntry[str]]) -> list[Path]:
    removed = []
    for entry in entries:
        match = _TEMP_NAME.fullmatch(entry.name)
        if match is None or pid_is_live(int(match["pid"])):
            continue
        path = Path(entry.path)
        if match["kind"] == "old" and not os.path.lexists(folder / match["target"]):
            log.warning("retention: kept %s: its writer died before renaming the new copy into place", path)
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError as error:
            if error.errno != errno.ENOENT:  # gone already: someone else cleaned up
                log.warning("retention: orphaned temporary %s not removed: %s", path, error)
            continue
        log.info("retention: removed orphaned temporary %s", path)
        removed.append(path)
    return removed
