"""Rank 0's outputs: the background writer, and the per-run progress log
`run_*/logs/trainer_progress.csv` (one row per step).

`BackgroundWriter` runs the output jobs (broadcast adapters, checkpoints, progress rows) on one
thread in submission order, so the next iteration's forward and backward overlap the fsyncs;
each job holds copies of the state it writes. The queue is bounded: a slow disk slows the
trainer instead of filling memory. The `logs/` level is made with `RunDir.ensure_dir` and the
CSV opened without creating parents, so a run deleted meanwhile stays deleted.
"""

from __future__ import annotations

import csv
import io
import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from rlplex.errors import MultiRunError, RunDirGoneError
from rlplex.multirun.rundir import RunDir

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
            path = directory / PROGRESS_CSV
            new = not path.exists()
            buffer = io.StringIO()
            writer = csv.DictWriter(buffer, fieldnames=list(row))
            if new:
                writer.writeheader()
            writer.writerow(row)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "a") as handle:
                handle.write(buffer.getvalue())
        except (OSError, RunDirGoneError, MultiRunError) as error:
            log.warning("run %s: progress row not written: %s", run.run_id, error)


def read_progress_csv(run: RunDir) -> list[dict[str, float]]:
    """The rows written so far, numbers as floats (for tests and benchmarks)."""
    with open(progress_csv_path(run), newline="") as handle:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(handle)]
