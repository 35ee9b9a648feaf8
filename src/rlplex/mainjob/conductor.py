"""The conductor: the main job's driver role. It plays the job's scripted events (a run added,
a run evicted) when their trigger fires, and ends the job once every run is done: it asks the
trainer's nodes to stop (a control RPC: the trainer's graceful stop), waits for them to finish,
and returns, which stops the job (a job ends when its drivers finish).

It acts only through the interfaces a user has: an added run is an add request (as `rlplex
runs add`), an eviction is the run's `control/evicted.txt` (as `rlplex runs evict`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from rlplex.config import StrictModel
from rlplex.control.job.states import NodeState
from rlplex.control.job.store import JobStore, NodeRecord
from rlplex.control.node.worker import WorkerContext
from rlplex.errors import WaitTimeoutError
from rlplex.mainjob.config import Event, MainJobConfig
from rlplex.mainjob.registry import submit_add
from rlplex.mainjob.view import RunView, collect
from rlplex.multirun.rundir import RunDir, write_eviction
from rlplex.multirun.trainer.job import ASK_AGAIN_S, ELASTIC_ROLE, TRAINER_ROLE, ask_trainer_to_stop

log = logging.getLogger(__name__)

TERMINAL_RUN_STATES = ("finished", "evicted", "rejected")
POLL_S = 0.25  # the file system has no change notification we can rely on everywhere
STOP_TIMEOUT_S = 120.0


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


class ConductorConfig(StrictModel):
    """`[roles.conductor.config]`: the whole main job."""

    job: MainJobConfig


def conduct(context: WorkerContext) -> None:
    config = ConductorConfig.model_validate(context.config).job
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
    _stop_trainer(context)


conduct.config_model = ConductorConfig  # type: ignore[attr-defined]  # the role's config, checked at load


def _stop_trainer(context: WorkerContext) -> None:
    """Ask the trainer's ranks to stop gracefully through the control plane (`ElasticWorker.
    request_stop`: each checkpoints every run ahead of its last checkpoint and exits 0, so the
    ElasticMaster finishes), and wait until the trainer's nodes have finished. The ask is
    repeated while they run: a rank restarted meanwhile must hear it too."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    with JobStore.open_readonly(context.output_dir, context.job_id) as job:
        while not context.should_stop():
            ask_trainer_to_stop(context.output_dir, context.job_id, context.token, timeout_s=POLL_S)
            ask_again = min(deadline, time.monotonic() + ASK_AGAIN_S)
            try:
                for role in (TRAINER_ROLE, ELASTIC_ROLE):
                    job.wait_nodes(role, _ended, ask_again - time.monotonic(), POLL_S, context.should_stop, False)
                return
            except WaitTimeoutError:
                if time.monotonic() >= deadline:
                    states = {n.node_id: n.state for n in job.nodes(TRAINER_ROLE) + job.nodes(ELASTIC_ROLE)}
                    raise WaitTimeoutError(
                        f"trainer nodes still {states} {STOP_TIMEOUT_S:g} s after the stop request"
                    ) from None


def _ended(node: NodeRecord) -> bool:
    return node.state in (NodeState.FINISHED, NodeState.STOPPED)
