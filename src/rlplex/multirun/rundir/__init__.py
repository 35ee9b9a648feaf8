"""The run directory protocol: the only contract between an orchestrator and the trainer.

```
{output_dir}/run_<id>/
    control/identity                     the run's identity (a random hex id), written once when
                                         the directory is first made (orchestrator or trainer)
    control/orch.toml                    written by the orchestrator
    control/config_validation_error.txt  written by the trainer when orch.toml is rejected
    control/evicted.txt                  eviction reason (trainer or the orchestrator itself)
    control/finished.txt                 written by the trainer once the last step is checkpointed
                                         and broadcast (JSON: step, time); the run leaves its slot
    checkpoints/step_N/                  per-run trainer checkpoints (STABLE marker last)
    rollouts/step_N/                     rollouts written by the orchestrator
    broadcast/step_N/                    adapter weights for inference (STABLE marker last)
{output_dir}/evictions/run_<id>.json     an eviction whose run folder refused control/evicted.txt
                                         (full, read-only): its reason and the run's identity
```

Writes never recreate a run directory: the run directory itself is never created here, and
each missing level below it is made with a single `mkdir` (no `parents=True`), which fails
if the level above has been deleted. A run deleted during a checkpoint therefore stays
deleted instead of coming back as a zombie. Writes refuse to go through symlinks so that a
run directory cannot redirect the trainer's or its orchestrator's writes outside `output_dir`.

A name is not an identity: a run directory deleted and made again under the same name often
gets the freed inode back (ext4 hands it straight out), so `control/identity` tells the runs
apart. A `RunDir` bound to an identity (`bound`) refuses every write once the directory on
disk holds another identity or none, so a write queued for a run that is gone is dropped
instead of landing in its successor. Every file read from a run goes through
`rlplex.io.safe_files` (regular files within a size cap, nothing reached through a link out).

This module is the layout and its markers; the folders' contents are the submodules: `rollouts`
(rollouts/step_N), `checkpoint` (checkpoints/step_N), `peft_export` (broadcast/step_N) and
`retention` (which step folders stay).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from rlplex.errors import MultiRunError, RunDirGoneError, UnsafeFileError
from rlplex.io.safe_files import is_safe_name, make_real_dir, read_regular_file, read_regular_text, write_file_atomic

RUN_PREFIX = "run_"
IDENTITY_FILE = "identity"
_IDENTITY = re.compile(r"^[0-9a-f]{32}$")
STEP_PREFIX = "step_"
STABLE_MARKER = "STABLE"


def is_valid_run_name(name: str) -> bool:
    return name.startswith(RUN_PREFIX) and is_safe_name(name[len(RUN_PREFIX) :])


def run_folder_problem(entry: os.DirEntry[str] | Path) -> str | None:
    """Why `entry` (an existing `runs/run_*` entry) cannot be a run's folder, or None. The
    trainer ignores such an entry; `rlplex runs add` refuses a run id that names one."""
    if entry.is_symlink():
        return "it is a symlink (a run directory must live inside output_dir)"
    # Not a link: following links or not, is_dir says the same (a DirEntry answers from d_type).
    return None if entry.is_dir() else "it is not a directory"


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step}"


def parse_step(name: str) -> int | None:
    suffix = name[len(STEP_PREFIX) :]
    if name.startswith(STEP_PREFIX) and suffix.isascii() and suffix.isdigit():
        return int(suffix)
    return None


@dataclass(frozen=True)
class RunDir:
    """Paths of one run and writes that stay inside directories that still exist."""

    output_dir: Path
    run_id: str
    identity: str | None = None
    """When set, writes go through only while `control/identity` holds this value."""

    def __post_init__(self) -> None:
        if not is_valid_run_name(self.run_id):
            raise MultiRunError(f"{self.run_id!r} is not a valid run id (expected run_<letters, digits, _ . ->)")

    @property
    def root(self) -> Path:
        return self.output_dir / self.run_id

    @property
    def control(self) -> Path:
        return self.root / "control"

    @property
    def identity_file(self) -> Path:
        return self.control / IDENTITY_FILE

    def bound(self, identity: str | None) -> RunDir:
        """This run directory, its writes refused unless `control/identity` is `identity`."""
        return replace(self, identity=identity)

    def read_identity(self) -> str | None:
        """The identity on disk (None: missing, unreadable, or not an identity)."""
        try:
            text = read_regular_text(self.identity_file, 4096, within=self.root).strip()
        except OSError:
            return None
        return text if _IDENTITY.fullmatch(text) else None

    def ensure_identity(self) -> str:
        """The run's identity, written now if the directory has none (exactly once, whoever races)."""
        found = self.read_identity()
        if found is not None:
            return found
        parent = replace(self, identity=None).ensure_dir("control")
        tmp = parent / f".{IDENTITY_FILE}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        write_file_atomic(tmp, (uuid.uuid4().hex + "\n").encode())
        try:
            os.link(tmp, self.identity_file)  # fails if another writer got there first: theirs stands
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        found = self.read_identity()
        if found is None:
            raise MultiRunError(f"{self.identity_file}: exists but holds no identity (expected 32 hex digits)")
        return found

    def check_identity(self) -> None:
        """Raise `RunDirGoneError` if this bound run's directory now belongs to another run."""
        if self.identity is None:
            return
        found = self.read_identity()
        if found != self.identity:
            now = "no identity" if found is None else f"identity {found}"
            raise RunDirGoneError(
                f"{self.root}: the run directory was replaced (it has {now}, this run was {self.identity}); "
                "nothing written"
            )

    @property
    def orch_config(self) -> Path:
        return self.control / "orch.toml"

    @property
    def config_error(self) -> Path:
        return self.control / "config_validation_error.txt"

    @property
    def evicted(self) -> Path:
        return self.control / "evicted.txt"

    @property
    def finished(self) -> Path:
        return self.control / "finished.txt"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts"

    @property
    def broadcast(self) -> Path:
        return self.root / "broadcast"

    @property
    def evaluations(self) -> Path:
        """The held-out evaluation's `progress.csv` (and TensorBoard files), one row per policy step."""
        return self.root / "eval"

    def checkpoint_step(self, step: int) -> Path:
        return self.checkpoints / step_dir_name(step)

    def rollout_step(self, step: int) -> Path:
        return self.rollouts / step_dir_name(step)

    def broadcast_step(self, step: int) -> Path:
        return self.broadcast / step_dir_name(step)

    def exists(self) -> bool:
        """True if the run directory is a real directory (a symlink does not count)."""
        try:
            return stat.S_ISDIR(os.lstat(self.root).st_mode)
        except OSError:
            return False

    def is_evicted(self) -> bool:
        return os.path.exists(self.evicted)

    def eviction_reason(self) -> str | None:
        try:
            return read_regular_text(self.evicted, within=self.root).strip()
        except OSError:
            return None

    def unwritten_eviction(self) -> str | None:
        """The reason this run was evicted when its folder could not hold the marker (a full or
        read-only run folder; None: it was not), from `EVICTIONS_DIR` beside the runs."""
        entry = _read_unwritten_eviction(self.output_dir, self.run_id)
        if entry is None or entry[0] != self.read_identity():
            return None  # another run now has that name
        return entry[1]

    def is_finished(self) -> bool:
        return os.path.exists(self.finished)

    def finished_step(self) -> int | None:
        """The step `control/finished.txt` records (None: no marker, or one that does not parse)."""
        try:
            record = json.loads(read_regular_file(self.finished, within=self.root))
        except (OSError, ValueError):
            return None
        step = record.get("step") if isinstance(record, dict) else None
        return step if isinstance(step, int) and not isinstance(step, bool) else None

    def ensure_dir(self, *parts: str) -> Path:
        """Make `root/parts...` one level at a time; raise `RunDirGoneError` if the run is gone."""
        if not self.exists():
            raise RunDirGoneError(f"{self.root}: run directory does not exist; nothing written")
        self.check_identity()
        current = self.root
        for part in parts:
            if part in ("", ".", "..") or "/" in part:
                raise MultiRunError(f"{self.root}: refusing path component {part!r}")
            current = current / part
            try:
                make_real_dir(current)
            except FileNotFoundError:
                raise RunDirGoneError(f"{self.root}: run directory was deleted; {current} not created") from None
            except UnsafeFileError as error:
                raise MultiRunError(str(error)) from None
        return current

    def check_writable(self) -> None:
        """Write and remove a file in `control/`: a folder that refuses writes (read-only, full)
        raises its `OSError` now, before a model loads and a step is generated for nothing."""
        probe = self.ensure_dir("control") / f".write-probe-{os.getpid()}"
        write_file_atomic(probe, b"")
        os.unlink(probe)

    def write_text(self, path: Path, text: str) -> None:
        """Atomically write `text` to `path`, a file below the run directory."""
        relative = path.relative_to(self.root)
        parent = self.ensure_dir(*relative.parent.parts)
        write_file_atomic(parent / relative.name, text.encode("utf-8"))

    def remove_file(self, path: Path) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def write_eviction(run: RunDir, reason: str) -> None:
    """Evict `run` with `reason`: the one way a run gets evicted (the trainer's `evict_run`, an
    orchestrator evicting itself, `rlplex runs evict`), so the format has one definition.

    `control/evicted.txt` holds the reason and one trailing newline. When the run's own folder
    refuses the write (full, read-only, not a folder), the eviction is recorded beside the runs
    instead (`EVICTIONS_DIR/<run id>.json`, with the run's identity), which `RunDir.unwritten_eviction`
    reads: the trainer, the run's orchestrator and the view take it as the same eviction.
    Raises `RunDirGoneError` when the run is deleted or replaced, and the folder's error when
    the record beside the runs cannot be written either.
    """
    text = reason.rstrip("\n") + "\n"
    try:
        run.write_text(run.evicted, text)
    except RunDirGoneError:
        raise
    except (OSError, MultiRunError) as error:
        try:
            _record_eviction_beside(run, f"{reason.rstrip()} ({run.evicted} not written: {error})")
        except OSError:
            raise error from None


EVICTIONS_DIR = "evictions"
"""Beside the run folders: one `<run id>.json` per eviction its run folder refused to hold."""


def unwritten_eviction_path(output_dir: Path, run_id: str) -> Path:
    return Path(output_dir) / EVICTIONS_DIR / f"{run_id}.json"


def _record_eviction_beside(run: RunDir, reason: str) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(run.output_dir / EVICTIONS_DIR)  # one level: never recreate a deleted output folder
    record = {"identity": run.identity or run.read_identity(), "reason": reason}
    write_file_atomic(unwritten_eviction_path(run.output_dir, run.run_id), (json.dumps(record) + "\n").encode())


def read_unwritten_evictions(output_dir: Path) -> dict[str, tuple[str | None, str]]:
    """Run id -> (identity, reason) of the evictions recorded beside the runs."""
    try:
        names = os.listdir(Path(output_dir) / EVICTIONS_DIR)
    except OSError:
        return {}
    found: dict[str, tuple[str | None, str]] = {}
    for name in names:
        run_id = name.removesuffix(".json")
        if name.endswith(".json") and is_valid_run_name(run_id):
            entry = _read_unwritten_eviction(output_dir, run_id)
            if entry is not None:
                found[run_id] = entry
    return found


def _read_unwritten_eviction(output_dir: Path, run_id: str) -> tuple[str | None, str] | None:
    try:
        record = json.loads(read_regular_file(unwritten_eviction_path(output_dir, run_id), 1 << 20))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("reason"), str):
        return None
    identity = record.get("identity")
    return (identity if isinstance(identity, str) else None, record["reason"])


def remove_unwritten_eviction(output_dir: Path, run_id: str) -> None:
    """Forget the record of `run_id` (its folder is gone, or now holds another run)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(unwritten_eviction_path(output_dir, run_id))


def write_finished(run: RunDir, step: int) -> None:
    """Write `control/finished.txt` atomically: the run trained `step` steps and is done.

    Only the trainer writes it, after the final checkpoint and broadcast are STABLE; the
    manager then frees the run's slot and never admits the run again.
    """
    record = {"step": step, "time": time.time(), "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    run.write_text(run.finished, json.dumps(record) + "\n")


def stable_steps(parent: Path) -> list[tuple[int, Path]]:
    """The `step_N` directories under `parent` that carry the STABLE marker, oldest first."""
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return []
    found = []
    for entry in entries:
        step = parse_step(entry.name)
        path = Path(entry.path)
        if step is not None and entry.is_dir(follow_symlinks=False) and os.path.exists(path / STABLE_MARKER):
            found.append((step, path))
    return sorted(found)
