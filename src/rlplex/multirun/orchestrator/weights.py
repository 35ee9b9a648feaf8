"""The orchestrator's side of the weights: the trainer's newest STABLE broadcast of a run, where a
restarted orchestrator resumes, and the wait for the adapter a step may generate with, which
eviction, a rejected config or a deleted run folder ends with an error (see `loop`)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from rlplex.errors import MultiRunError, RunConfigError, RunDirGoneError, WaitTimeoutError
from rlplex.io.safe_files import read_regular_text
from rlplex.multirun.rundir import RunDir, stable_steps
from rlplex.multirun.rundir.peft_export import is_stable_adapter
from rlplex.multirun.rundir.rollouts import rollouts_ready

_PROGRESS_EVERY_S = 10.0


class RunEvictedError(MultiRunError, RuntimeError):
    """The run has `control/evicted.txt`: the orchestrator stops and reports the reason."""


@dataclass(frozen=True)
class WaitOptions:
    timeout_s: float | None = None  # None: wait as long as the trainer needs
    poll_s: float = 0.05


def say(message: str) -> None:
    print(f"[orchestrator] {message}", file=sys.stderr, flush=True)


def check_evicted(run: RunDir) -> None:
    # An eviction the trainer could not mark in the run folder (full, read-only) ends the run too.
    if run.is_evicted():
        reason = run.eviction_reason() or "no reason given"
    elif (unwritten := run.unwritten_eviction()) is not None:
        reason = unwritten
    else:
        return
    raise RunEvictedError(f"{run.run_id} evicted: {' | '.join(reason.splitlines())}")  # one line on stderr


def latest_stable_broadcast(run: RunDir) -> int | None:
    """The newest complete `broadcast/step_k` of this run. A step folder that is a symlink, or
    that leads out of the run, is passed over: it may be another run's adapter."""
    steps = reversed(stable_steps(run.broadcast))
    return next((step for step, path in steps if is_stable_adapter(path, within=run.root)), None)


def first_unfinished_step(run: RunDir, max_steps: int) -> int:
    """The first step, from the trainer's newest broadcast on, whose rollouts are not STABLE
    (max_steps when all are). Rollouts below the newest broadcast step are trained, and the
    trainer's retention may have removed them."""
    start = latest_stable_broadcast(run) or 0
    return next((s for s in range(start, max_steps) if not rollouts_ready(run, s)), max_steps)


def wait_for_broadcast(run: RunDir, at_least: int, what: str, options: WaitOptions) -> int:
    """Block until a STABLE `broadcast/step_k` with k >= at_least exists; return the latest k.

    Eviction, a rejected config and a deleted run directory end the wait with an error.
    """
    start = time.monotonic()
    last_report = None
    while True:
        latest = latest_stable_broadcast(run)
        if latest is not None and latest >= at_least:
            return latest
        check_evicted(run)
        if not run.exists():
            raise RunDirGoneError(f"{run.root}: run directory was deleted while waiting for the trainer")
        run.check_identity()
        if run.config_error.is_file():
            reason = read_regular_text(run.config_error, within=run.root).strip()
            raise RunConfigError(f"the trainer rejected {run.orch_config}: {reason}")
        if run.is_finished():
            raise RunConfigError(
                f"{run.run_id}: the trainer marked the run finished at step {run.finished_step()}, "
                f"but this orchestrator waits for step {at_least} (is {run.orch_config} what was admitted?)"
            )
        waited = time.monotonic() - start
        if last_report is None or waited - last_report >= _PROGRESS_EVERY_S:
            last_report = waited
            say(f"{run.run_id}: {what} waiting for broadcast step >= {at_least} (latest {latest}, {waited:.0f} s)")
        if options.timeout_s is not None and waited >= options.timeout_s:
            raise WaitTimeoutError(
                f"{run.run_id}: no STABLE broadcast step >= {at_least} after {options.timeout_s:g} s (latest {latest})"
            )
        time.sleep(options.poll_s)
