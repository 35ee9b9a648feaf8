"""The trainer's per-run progress log: `run_*/logs/trainer_progress.csv`, one row per step.

Appended by rank 0 after each step of a run. The `logs/` level is made with `RunDir.ensure_dir`
and the file opened without creating parents, so a run deleted meanwhile stays deleted.
"""

from __future__ import annotations

import csv
import io
import logging
import os
from typing import Any

from rlplex.errors import MultiRunError, RunDirGoneError
from rlplex.multirun.rundir import RunDir

log = logging.getLogger(__name__)

PROGRESS_CSV = "trainer_progress.csv"


def progress_csv_path(run: RunDir) -> os.PathLike[str]:
    return run.root / "logs" / PROGRESS_CSV


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
