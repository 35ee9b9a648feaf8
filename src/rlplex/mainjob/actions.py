"""What `rlplex runs evict` does, as a function: the command and the dashboard's button call it."""

from __future__ import annotations

from pathlib import Path

from rlplex.errors import ConfigError
from rlplex.mainjob.conductor import evict
from rlplex.mainjob.view import collect
from rlplex.multirun.rundir import RunDir, is_valid_run_name


def evict_run(output_dir: Path, run_id: str, reason: str) -> str:
    """Evict `run_id` with `reason` (its orchestrator stops, the trainer frees its slot); a
    one-line `ConfigError` for a run that is not there, an empty reason or a run already ended."""
    runs_dir = output_dir / "runs"
    if not is_valid_run_name(run_id) or not RunDir(runs_dir, run_id).exists():
        raise ConfigError(f"{runs_dir / run_id}: no such run")
    if not reason.strip():
        raise ConfigError("--reason: empty; say why the run is evicted")
    current = {run.run_id: run for run in collect(output_dir).runs}.get(run_id)
    if current is not None and current.state in ("finished", "evicted", "rejected"):
        # An end is final: evicting again would overwrite the first reason, and a finished run
        # would turn into an evicted one.
        why = f" ({current.reason})" if current.reason else ""
        raise ConfigError(f"{runs_dir / run_id}: the run is already {current.state}{why}; not evicted")
    evict(runs_dir, run_id, reason)
    return f"{run_id}: evicted ({reason})"
