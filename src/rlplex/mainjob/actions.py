"""What `rlplex runs add` and `rlplex runs evict` do, as functions: the commands and the
dashboard's actions call them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlplex.config import check_config_kind, validate_config
from rlplex.errors import ConfigError
from rlplex.mainjob.conductor import evict
from rlplex.mainjob.config import RunEntry
from rlplex.mainjob.driver import read_job_model
from rlplex.mainjob.registry import submit_add, wait_for_answer
from rlplex.mainjob.view import collect
from rlplex.multirun.rundir import RunDir, is_valid_run_name


def add_run(
    output_dir: Path, run_id: str, config: dict[str, Any], source: str, id_source: str, timeout_s: float
) -> tuple[bool, str]:
    """Ask the running job in `output_dir` to add run `run_id` with `config` (a run's TOML, read;
    `source` names it in errors, `id_source` names where the id came from) and wait up to
    `timeout_s` for its master: (True, how it was added) or (False, why not).

    The config is checked here as the master will check it, with the job's model filled in, so
    a typo is one `ConfigError` naming the field and value, and no request is left behind."""
    check_config_kind(config, source, "orch")
    entry = validate_config(RunEntry, {"id": run_id, "config": config}, source=id_source).with_local_model_resolved()
    model = read_job_model(output_dir)
    (entry.with_model(model) if model else entry).orch_config(source)
    return wait_for_answer(submit_add(output_dir, entry), timeout_s)


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
