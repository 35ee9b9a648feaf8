"""Rank 0's record of the checkpoints and broadcasts that could not be written (a full disk, a
read-only run folder), when each is tried again, and when a run is given up.

A failed write is tried again `retry_s` later at the run's current step, its checkpoint first
when the checkpoint is what failed: a run's broadcast is withheld while its newest checkpoint
failed, so the order that lets a resume never train a published step twice ("checkpoint before
broadcast") holds through a full disk. Its orchestrator waits for the missing broadcast, which
comes once the disk has room again. After `max_failures` failed attempts in a row the run is
evicted with the error. Other runs never notice: every write is one run's own job.

A run's state, kept by the trainer's thread from the writer thread's reports::

    OK ──failure──► FAILING (attempts += 1, retry at now + retry_s) ──due──► RETRYING
     ▲                                   ▲                                     │
     └──────── broadcast written ────────┴────────── failure ──────────────────┘

The writer reports every job's outcome; failures of one attempt (a checkpoint and the broadcast
withheld behind it) count once.
"""

from __future__ import annotations

import enum
import queue
from dataclasses import dataclass, field
from typing import Literal

OutputKind = Literal["checkpoint", "broadcast"]


@dataclass(frozen=True)
class WriteReport:
    run_id: str
    kind: OutputKind
    step: int
    error: str | None  # None: written


class _State(enum.Enum):
    FAILING = "failing"  # waiting for its retry time
    RETRYING = "retrying"  # the retry's jobs are queued


@dataclass
class _Failing:
    state: _State
    attempts: int
    error: str
    retry_at: float
    redo_checkpoint: bool = False


@dataclass(frozen=True)
class RetryPlan:
    """What the trainer does now: runs whose outputs are written again, runs given up."""

    retry: list[tuple[str, bool]] = field(default_factory=list)  # (run id, redo its checkpoint first)
    give_up: list[tuple[str, str]] = field(default_factory=list)  # (run id, reason)


class OutputRetries:
    def __init__(self, retry_s: float, max_failures: int) -> None:
        self.retry_s, self.max_failures = retry_s, max_failures
        self._reports: queue.SimpleQueue[WriteReport] = queue.SimpleQueue()
        self._failing: dict[str, _Failing] = {}
        self.checkpoint_failed: dict[str, str] = {}
        """Writer thread only: run id -> the error of its newest checkpoint, while it failed."""

    # ---- the writer thread --------------------------------------------------------------------
    def report(self, run_id: str, kind: OutputKind, step: int, error: str | None) -> None:
        if kind == "checkpoint":
            if error is None:
                self.checkpoint_failed.pop(run_id, None)
            else:
                self.checkpoint_failed[run_id] = error
        self._reports.put(WriteReport(run_id, kind, step, error))

    # ---- the trainer's thread -----------------------------------------------------------------
    def is_failing(self, run_id: str) -> bool:
        return run_id in self._failing

    def forget(self, run_id: str) -> None:
        self._failing.pop(run_id, None)
        self.checkpoint_failed.pop(run_id, None)

    def plan(self, now: float) -> RetryPlan:
        """Take in the writer's reports; the runs to write again now, and those to give up."""
        while not self._reports.empty():
            self._take(self._reports.get(), now)
        plan = RetryPlan()
        for run_id, failing in list(self._failing.items()):
            if failing.state is not _State.FAILING or now < failing.retry_at:
                continue
            if failing.attempts >= self.max_failures:
                del self._failing[run_id]
                plan.give_up.append((run_id, f"its outputs failed {failing.attempts} times in a row ({failing.error})"))
                continue
            failing.state = _State.RETRYING
            plan.retry.append((run_id, failing.redo_checkpoint))
        return plan

    def _take(self, report: WriteReport, now: float) -> None:
        failing = self._failing.get(report.run_id)
        if report.error is None:
            if report.kind == "broadcast":
                self._failing.pop(report.run_id, None)  # the orchestrator has what it waits for
            elif failing is not None:
                failing.redo_checkpoint = False
            return
        error = f"{report.kind} step {report.step}: {report.error}"
        if failing is None:
            failing = self._failing[report.run_id] = _Failing(_State.FAILING, 1, error, 0.0)
        elif failing.state is _State.RETRYING:
            failing.state, failing.attempts, failing.error = _State.FAILING, failing.attempts + 1, error
        # else: the same attempt's next job (the broadcast withheld behind a failed checkpoint):
        # the first error says what went wrong.
        failing.retry_at = now + self.retry_s
        if report.kind == "checkpoint":
            failing.redo_checkpoint = True
