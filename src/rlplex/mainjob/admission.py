"""What the trainer decided about a run added to a running main job (`rlplex runs add`).

The master's "accepted" only means the run got an orchestrator node; the trainer judges the
run's config when that node has written `control/orch.toml`. Its decision shows in files:

| decision | where |
| --- | --- |
| admitted | the run's first `broadcast/step_N` is STABLE (the trainer's initial adapter) |
| rejected | `rejected/<run id>.txt` (its orchestrator node), or `control/config_validation_error.txt` (the trainer) |
| evicted before admission | the run's `control/evicted.txt` with no broadcast |

Until one of these shows, validation is pending (or the run waits for a free slot).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlplex.control.job.states import JobState
from rlplex.io.safe_files import read_regular_text
from rlplex.mainjob.config import JOB_CONFIG_FILE
from rlplex.mainjob.registry import REJECTIONS_DIR, read_registry
from rlplex.mainjob.view import JobView, collect, run_view
from rlplex.multirun.rundir import RunDir, stable_steps

Outcome = Literal["admitted", "rejected", "pending"]
POLL_S = 0.3


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    text: str


def trainer_decision(output_dir: Path, run_id: str) -> Decision | None:
    """The trainer's decision on `run_id` as the files show it now (None: not decided yet)."""
    entry = next((e for e in read_registry(output_dir) if e.id == run_id), None)
    if entry is None:
        return None
    runs_dir = output_dir / "runs"
    view = run_view(runs_dir, entry)
    admitted = bool(stable_steps(RunDir(runs_dir, run_id).broadcast))
    if view.state == "rejected":
        return Decision("rejected", view.reason)
    if admitted:
        return Decision("admitted", f"{run_id}: admitted by the trainer")
    if view.state == "evicted":
        return Decision("rejected", f"evicted before the trainer admitted it: {view.reason}")
    if view.state == "finished":
        return Decision("admitted", f"{run_id}: admitted by the trainer (and already finished)")
    return None


def pending_text(output_dir: Path, run_id: str, waited_s: float) -> str:
    """Why there is no decision yet, and where it will show."""
    view = collect(output_dir)
    running = sum(run.state == "running" for run in view.runs)
    max_runs = _max_runs(output_dir)
    if _job_over(view):
        gone = f", but its master (pid {view.master_pid}) is gone: `rlplex resume {output_dir}`"
        why = f"the job is {view.outcome}" + (gone if view.master_gone else "")
    elif max_runs is not None and running >= max_runs:
        why = f"it waits for a free slot (all {max_runs} of the trainer's max_runs are taken)"
    else:
        why = f"the trainer has not judged it within {waited_s:g} s"
    return (
        f"{run_id}: validation pending: {why}; `rlplex status {output_dir}` shows its state, and a rejection's "
        f"reason lands in {output_dir / REJECTIONS_DIR / (run_id + '.txt')} or "
        f"{RunDir(output_dir / 'runs', run_id).config_error}"
    )


def wait_for_trainer(
    output_dir: Path, run_id: str, wait_s: float, on_wait: Callable[[float], None] | None = None
) -> Decision:
    """Wait up to `wait_s` for the trainer to admit or reject `run_id`; `on_wait(elapsed_s)` is
    called between looks. A job that ends meanwhile ends the wait."""
    started = time.monotonic()
    while True:
        decision = trainer_decision(output_dir, run_id)
        if decision is not None:
            return decision
        elapsed = time.monotonic() - started
        if elapsed >= wait_s or _job_over(collect(output_dir)):
            return Decision("pending", pending_text(output_dir, run_id, elapsed))
        if on_wait is not None:
            on_wait(elapsed)
        time.sleep(POLL_S)


def _job_over(view: JobView) -> bool:
    """No decision can come any more: the job ended, or its master is gone."""
    return view.job_state in (JobState.STOPPED, JobState.FAILED) or bool(view.master_pid and not view.master_alive)


def _max_runs(output_dir: Path) -> int | None:
    try:
        value = json.loads(read_regular_text(output_dir / JOB_CONFIG_FILE))["trainer"]["max_runs"]
        return int(value)
    except (OSError, ValueError, KeyError, TypeError):
        return None
