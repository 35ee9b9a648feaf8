"""Rank 0's outputs: the background writer, the per-run progress log
`run_*/logs/trainer_progress.csv` (one row per step), and the finished marker.

`BackgroundWriter` runs the output jobs (broadcast adapters, checkpoints, progress rows) on one
thread in submission order, so the next iteration's forward and backward overlap the fsyncs;
each job holds copies of the state it writes. The queue is bounded: a slow disk slows the
trainer instead of filling memory. The `logs/` level is made with `RunDir.ensure_dir` and the
CSV opened without creating parents, so a run deleted meanwhile stays deleted.

`RunFinisher` writes a run's `control/finished.txt` as a writer job. Jobs run in submission
order, so a marker submitted after the final step's checkpoint and broadcast jobs runs after
them; it still checks that both are STABLE on disk, and if one is not (a full disk, say) it
writes nothing and the trainer tries again `retry_s` later.
"""

from __future__ import annotations

import csv
import io
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from rlplex.errors import MultiRunError, RunDirGoneError
from rlplex.io.safe_files import append_regular_file
from rlplex.multirun.rundir import STABLE_MARKER, RunDir, write_finished
from rlplex.multirun.rundir.peft_export import is_stable_adapter

log = logging.getLogger(__name__)

PROGRESS_CSV = "trainer_progress.csv"


def progress_csv_path(run: RunDir) -> os.PathLike[str]:
    return run.root / "logs" / PROGRESS_CSV


class BackgroundWriter:
    def __init__(self, max_pending: int = 64) -> None:
        self._queue: queue.Queue[Callable[[], None]] = queue.Queue(maxsize=max_pending)
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="rlplex-trainer-writer", daemon=True)
            self._thread.start()
        self._queue.put(job)

    def flush(self) -> None:
        self._queue.join()

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            try:
                job()
            except Exception:  # one failed write must not stop the others (each job logs its own faults)
                log.exception("trainer output job failed")
            finally:
                self._queue.task_done()


class ProgressLog:
    def append(self, run: RunDir, row: dict[str, Any]) -> None:
        try:
            directory = run.ensure_dir("logs")
            header, line = io.StringIO(), io.StringIO()
            csv.DictWriter(header, fieldnames=list(row)).writeheader()
            csv.DictWriter(line, fieldnames=list(row)).writerow(row)
            append_regular_file(directory / PROGRESS_CSV, line.getvalue().encode(), header.getvalue().encode())
        except (OSError, RunDirGoneError, MultiRunError) as error:
            log.warning("run %s: progress row not written: %s", run.run_id, error)


def read_progress_csv(run: RunDir) -> list[dict[str, float]]:
    """The rows written so far, numbers as floats (for tests and benchmarks)."""
    with open(progress_csv_path(run), newline="") as handle:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(handle)]


def final_outputs_missing(run: RunDir, step: int) -> list[str]:
    """Which of the step's outputs, "checkpoint" and "broadcast", are not STABLE on disk."""
    missing = []
    if not os.path.exists(run.checkpoint_step(step) / STABLE_MARKER):
        missing.append("checkpoint")
    if not is_stable_adapter(run.broadcast_step(step), within=run.root):
        missing.append("broadcast")
    return missing


class RunFinisher:
    """Rank 0's record of the finished markers submitted, and of those that must be tried again."""

    def __init__(self, writer: BackgroundWriter, retry_s: float) -> None:
        self.writer, self.retry_s = writer, retry_s
        self._submitted: set[str] = set()
        self._retry_at: dict[str, float] = {}
        self._failed: queue.SimpleQueue[str] = queue.SimpleQueue()  # filled by the writer thread

    def due(self, run_id: str, now: float | None = None) -> bool:
        """True if no marker job of `run_id` is queued and its retry time (after a failure) has come."""
        while not self._failed.empty():
            failed = self._failed.get()
            if failed in self._submitted:
                self._submitted.discard(failed)
                self._retry_at[failed] = time.monotonic() + self.retry_s
        if run_id in self._submitted:
            return False
        return (now if now is not None else time.monotonic()) >= self._retry_at.get(run_id, 0.0)

    def forget(self, run_id: str) -> None:
        self._submitted.discard(run_id)
        self._retry_at.pop(run_id, None)

    def submit(self, run: RunDir, step: int) -> None:
        run_id = run.run_id
        self._submitted.add(run_id)

        def job() -> None:
            if run.is_evicted():
                return  # evicted meanwhile: it leaves as evicted, not finished
            missing = final_outputs_missing(run, step)
            if missing:
                what = " and ".join(f"{kind} step {step}" for kind in missing)
                log.warning("run %s: not marked finished at step %d: %s not STABLE; will retry", run_id, step, what)
                self._failed.put(run_id)
                return
            try:
                write_finished(run, step)
            except RunDirGoneError:
                log.warning("run %s: deleted before it could be marked finished", run_id)
                return
            except (OSError, MultiRunError) as error:
                log.warning("run %s: %s not written: %s; will retry", run_id, run.finished, error)
                self._failed.put(run_id)
                return
            log.info("run %s: marked finished at step %d (checkpoint and broadcast STABLE)", run_id, step)

        self.writer.submit(job)
