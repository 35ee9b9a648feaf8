"""Per-run checkpoints in `checkpoints/step_N`: written whole or not at all, STABLE marker last.

A checkpoint is first written into a hidden temporary sibling (`.step_N.tmp-<pid>`), renamed
to `step_N`, and only then marked with `STABLE`. A reader takes the newest step that has the
marker, so a crash or a full disk at any point leaves the previous stable checkpoint the one
that resumes. The run directory is never recreated (see `rundir`).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from rlplex.errors import CheckpointError, RunDirGoneError, SnapshotError
from rlplex.multirun.rundir import STABLE_MARKER, RunDir, parse_step, stable_steps, step_dir_name, write_file_atomic
from rlplex.runners.snapshot import read_snapshot, write_snapshot_into

PROGRESS_FILE = "progress.json"


@dataclass
class RunProgress:
    """Training progress of one run, counted by the trainer."""

    step: int = 0
    total_tokens: int = 0
    total_samples: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> RunProgress:
        return cls(
            step=int(state["step"]), total_tokens=int(state["total_tokens"]), total_samples=int(state["total_samples"])
        )


@dataclass
class RunCheckpoint:
    step: int
    path: Path
    adapter: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    progress: RunProgress


def save_checkpoint(
    run: RunDir,
    step: int,
    adapter_state: dict[str, Any],
    optimizer_state: dict[str, Any],
    scheduler_state: dict[str, Any],
    progress: RunProgress,
) -> Path:
    """Write `checkpoints/step_<step>` atomically and mark it STABLE; return its path."""
    parent = run.ensure_dir("checkpoints")
    final = parent / step_dir_name(step)
    tmp = parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.mkdir(tmp)
    except FileNotFoundError:
        raise RunDirGoneError(f"{run.root}: run directory was deleted; checkpoint step {step} not written") from None
    state = {"adapter": adapter_state, "optimizer": optimizer_state, "scheduler": scheduler_state}
    try:
        write_snapshot_into(tmp, state)
        write_file_atomic(tmp / PROGRESS_FILE, json.dumps(progress.state_dict()).encode())
        if os.path.lexists(final):
            # An earlier, possibly unmarked, attempt at the same step: replace it whole.
            shutil.rmtree(final)
        os.rename(tmp, final)
        write_file_atomic(final / STABLE_MARKER, b"")
    except (OSError, SafetensorError) as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if not run.exists():
            raise RunDirGoneError(f"{run.root}: run directory was deleted during checkpoint step {step}") from error
        raise CheckpointError(
            f"{final}: checkpoint of {run.run_id} at step {step} not written ({error}); "
            "the previous stable checkpoint is unchanged"
        ) from error
    return final


def stable_checkpoints(run: RunDir) -> list[tuple[int, Path]]:
    """Steps that carry the STABLE marker, oldest first."""
    return stable_steps(run.checkpoints)


def latest_stable_checkpoint_path(run: RunDir) -> Path | None:
    found = stable_checkpoints(run)
    return found[-1][1] if found else None


def read_checkpoint_progress(path: Path) -> RunProgress:
    try:
        return RunProgress.from_state_dict(json.loads((path / PROGRESS_FILE).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{path / PROGRESS_FILE}: unreadable progress: {error}") from None


def load_checkpoint(path: Path) -> RunCheckpoint:
    step = parse_step(path.name)
    if step is None or not (path / STABLE_MARKER).exists():
        raise CheckpointError(f"{path}: not a stable checkpoint (no {STABLE_MARKER} marker)")
    try:
        state = read_snapshot(path)
    except SnapshotError as error:
        raise CheckpointError(str(error)) from None
    return RunCheckpoint(
        step=step,
        path=path,
        adapter=state["adapter"],
        optimizer=state["optimizer"],
        scheduler=state["scheduler"],
        progress=read_checkpoint_progress(path),
    )
