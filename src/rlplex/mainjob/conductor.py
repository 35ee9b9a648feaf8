"""The conductor: the main job's driver role. It plays the job's scripted events (a run added,
a run evicted) when their trigger fires, and ends the job once every run is done: it tells the
trainer to stop (its stop file), waits for the trainer's ranks to finish, and returns, which
stops the job (a job ends when its drivers finish).

It acts only through the interfaces a user has: an added run is an add request (as `rlplex
runs add`), an eviction is the run's `control/evicted.txt` (as `rlplex runs evict`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from rlplex.control.store import SqliteStateStore
from rlplex.control.worker import WorkerContext
from rlplex.errors import WaitTimeoutError
from rlplex.mainjob.config import Event, MainJobConfig
from rlplex.mainjob.registry import submit_add
from rlplex.mainjob.view import RunView, collect
from rlplex.multirun.rundir import RunDir, write_eviction

log = logging.getLogger(__name__)

TERMINAL_RUN_STATES = ("finished", "evicted", "rejected")
TRAINER_STOP_FILE = "STOP_TRAINER"  # read by rlplex.multirun.trainer in its output dir
POLL_S = 0.25  # the file system has no change notification we can rely on everywhere


def evict(runs_dir: Path, run_id: str, reason: str) -> None:
    """What `rlplex runs evict` does: the trainer and the orchestrator read this file."""
    write_eviction(RunDir(runs_dir, run_id), reason.strip())


def _fires(event: Event, runs: dict[str, RunView]) -> bool:
    run = runs.get(event.when.run)
    return run is not None and run.trained_steps >= event.when.step


def _can_still_fire(event: Event, runs: dict[str, RunView], pending_adds: set[str]) -> bool:
    run = runs.get(event.when.run)
    if run is None:
        return event.when.run in pending_adds
    return run.state not in TERMINAL_RUN_STATES


def conduct(context: WorkerContext) -> None:
    config = MainJobConfig.model_validate(context.config["job"])
    output_dir, runs_dir = context.output_dir, config.runs_dir
    later = {entry.id: entry for entry in config.later_runs}
    pending = list(range(len(config.events)))
    added: set[str] = set()
    while not context.should_stop():
        runs = {run.run_id: run for run in collect(output_dir, runs_dir).runs}
        for number in list(pending):
            event = config.events[number]
            if _fires(event, runs):
                pending.remove(number)
                if event.add_run is not None:
                    submit_add(output_dir, later[event.add_run])
                    added.add(event.add_run)
                    log.warning("event %d: adding run %s", number, event.add_run)
                elif event.evict_run is not None and event.evict_run in runs:
                    evict(runs_dir, event.evict_run, event.reason)
                    log.warning("event %d: evicting run %s: %s", number, event.evict_run, event.reason)
            elif not _can_still_fire(event, runs, {e.add_run for e in config.events if e.add_run} - added):
                pending.remove(number)
                log.warning("event %d can no longer fire: run %s is done", number, event.when.run)
        done = sum(run.state in TERMINAL_RUN_STATES for run in runs.values())
        waiting_adds = added - set(runs)
        context.report_progress(runs_done=done, runs=len(runs), events_left=len(pending))
        if runs and done == len(runs) and not pending and not waiting_adds:
            break
        time.sleep(POLL_S)
    _stop_trainer(context, runs_dir, config)


def _stop_trainer(context: WorkerContext, runs_dir: Path, config: MainJobConfig) -> None:
    (runs_dir / TRAINER_STOP_FILE).write_text("every run is done\n")
    deadline = time.monotonic() + 120.0
    while not context.should_stop():
        states = _trainer_states(context)
        if states and all(state in ("FINISHED", "STOPPED") for state in states):
            return
        if time.monotonic() > deadline:
            raise WaitTimeoutError(f"trainer nodes still {states} 120 s after the stop request")
        time.sleep(POLL_S)


def _trainer_states(context: WorkerContext) -> list[str]:
    store = SqliteStateStore.in_dir(context.output_dir, create=False)
    try:
        return [node.state for node in store.nodes(context.job_id) if node.role in ("trainer", "elastic")]
    finally:
        store.close()
