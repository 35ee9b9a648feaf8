"""Per-run checkpoints in `checkpoints/step_N`: written whole or not at all, STABLE marker last.

A checkpoint is first written into a hidden temporary sibling (`.step_N.tmp-<pid>`), renamed
to `step_N`, and only then marked with `STABLE`. A reader takes the newest step that has the
marker and reads whole, so a crash, a full disk or a truncated file leaves the previous stable
checkpoint the one that resumes. The run directory is never recreated (see `rundir`).

Where a run resumes (`choose_resume`): a checkpoint holds the adapter, the optimizer and the
schedule, and is written every `checkpoint_every` steps; a broadcast adapter is written after
every step, with the trainer's counters beside it. A restart therefore takes its adapter and
step from the newest broadcast and its optimizer moments from the newest readable checkpoint
at or before it: the steps trained since that checkpoint are neither lost nor trained again
(the orchestrator has already sampled from that adapter), whatever `checkpoint_every` is.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from rlplex.errors import CheckpointError, RunDirGoneError, SnapshotError
from rlplex.io.safe_files import check_regular_file, fsync_dir, read_regular_file, write_file_atomic
from rlplex.io.snapshot import MAX_SNAPSHOT_BYTES, read_snapshot, write_snapshot_into
from rlplex.multirun.rundir import (
    STABLE_MARKER,
    RunDir,
    parse_step,
    stable_steps,
    step_dir_name,
)
from rlplex.multirun.rundir.peft_export import (
    ADAPTER_PROGRESS,
    ADAPTER_WEIGHTS,
    MAX_ADAPTER_BYTES,
    is_stable_adapter,
    read_adapter_progress,
)

log = logging.getLogger(__name__)

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
        fsync_dir(parent)
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


def _run_root(step_dir: Path) -> Path:
    """`run_x/checkpoints/step_N` (or `broadcast/step_N`) -> `run_x`: no read may lead out of it."""
    return step_dir.parent.parent


def read_checkpoint_progress(path: Path) -> RunProgress:
    try:
        return RunProgress.from_state_dict(json.loads(read_regular_file(path / PROGRESS_FILE, within=_run_root(path))))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{path / PROGRESS_FILE}: unreadable progress: {error}") from None


def _check_tensor_file(path: Path, max_bytes: int) -> None:
    """Raise unless `path` is a regular safetensors file whose header fits its size (not truncated)."""
    try:
        check_regular_file(path, max_bytes, within=_run_root(path.parent))
        # Opening parses the header and checks that the data covers the file exactly.
        with safe_open(str(path), framework="pt"):
            pass
    except (OSError, SafetensorError) as error:
        raise CheckpointError(f"{path}: unreadable tensors ({error})") from None


def check_checkpoint(path: Path) -> RunProgress:
    """The checkpoint's progress if every file of it reads whole; `CheckpointError` says what does not."""
    progress = read_checkpoint_progress(path)
    _check_tensor_file(path / "tensors.safetensors", MAX_SNAPSHOT_BYTES)
    try:
        json.loads(read_regular_file(path / "state.json", MAX_SNAPSHOT_BYTES, within=_run_root(path)))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path / 'state.json'}: unreadable ({error})") from None
    return progress


@dataclass(frozen=True)
class ResumePoint:
    """Where a run resumes: optimizer state from `checkpoint`, adapter from `adapter` when newer."""

    checkpoint: int | None
    adapter: int | None
    progress: RunProgress


def choose_resume(run: RunDir) -> ResumePoint:
    """Rank 0's choice of where `run` resumes (see the module docstring).

    A stable checkpoint or adapter that does not read whole (a truncated file, a missing
    progress) is passed over for the one before it. Raises `CheckpointError` (the run is then
    evicted, never silently restarted) when the run has stable checkpoints and none of them
    reads, or adapters newer than the checkpoint it resumes from and none of them reads.
    """
    checkpoint, progress, faults = None, RunProgress(), []
    for step, path in reversed(stable_checkpoints(run)):
        try:
            progress = check_checkpoint(path)
        except CheckpointError as error:
            faults.append(str(error))
            log.warning("run %s: passing over checkpoint step %d: %s", run.run_id, step, error)
            continue
        checkpoint = step
        break
    if checkpoint is None and faults:
        raise CheckpointError(f"no stable checkpoint of {run.run_id} reads whole: " + "; ".join(faults))
    adapter_faults = []
    for step, path in reversed(stable_steps(run.broadcast)):
        if step <= (checkpoint or 0):
            break
        try:
            adapter_progress = _check_adapter(path, step, run.root)
        except CheckpointError as error:
            adapter_faults.append(f"step {step}: {error}")
            log.warning("run %s: passing over broadcast step %d: %s", run.run_id, step, error)
            continue
        if adapter_progress is None:
            continue  # written before adapters carried their progress: an older one may
        return ResumePoint(checkpoint, step, adapter_progress)
    if adapter_faults:
        # The orchestrator sampled from those adapters: starting again from an older state would
        # train their steps a second time, and from nothing would throw the run's training away.
        where = f"checkpoint step {checkpoint}" if checkpoint is not None else "no checkpoint"
        raise CheckpointError(
            f"{run.run_id} has adapters past its newest readable checkpoint ({where}) and none of them reads: "
            + "; ".join(adapter_faults)
        )
    return ResumePoint(checkpoint, None, progress)


def _check_adapter(path: Path, step: int, run_root: Path) -> RunProgress | None:
    """The counters of the STABLE adapter at `path` if it reads whole (None: it carries none,
    as adapters of older rlplex versions); `CheckpointError` when it is damaged."""
    if not os.path.lexists(path / ADAPTER_PROGRESS):
        return None
    record = read_adapter_progress(path, within=run_root)
    if record is None or record.get("step") != step:
        raise CheckpointError(f"{path / ADAPTER_PROGRESS}: unreadable, or not of step {step} ({record!r:.80})")
    if not is_stable_adapter(path, within=run_root):
        raise CheckpointError(f"{path / ADAPTER_WEIGHTS}: missing, or not a regular file inside the run")
    _check_tensor_file(path / ADAPTER_WEIGHTS, MAX_ADAPTER_BYTES)
    try:
        return RunProgress.from_state_dict(record)
    except KeyError as error:
        raise CheckpointError(f"{path / ADAPTER_PROGRESS}: no {error} counter") from None


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
