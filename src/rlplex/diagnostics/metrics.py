"""A metrics logger with namespaced keys (`charts/...`, `losses/...`) writing CSV, fanned out to
the run's trackers (TensorBoard, W&B: `trackers.py`).

Keys must be namespaced so that TensorBoard groups them and so that a CSV column says what
it measures. New keys may appear after the first row (an evaluation metric, say): the CSV is
rewritten with the wider header, which is rare and cheap at log-interval granularity.

The folder may be one other processes can write (a multi-run run folder), so nothing is read or
written through a link placed in it: a `progress.csv` or `tb` that is a symlink (or a
`progress.csv` that is a hard link) raises `UnsafeFileError` naming it, and a rewrite goes
through `write_file_atomic`'s exclusively created temporary. The folder itself may be a link
(a path the user typed).
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from rlplex.diagnostics.trackers import Tracker, Tracking, close_all, finite
from rlplex.errors import RlplexError
from rlplex.io.safe_files import append_regular_file, read_regular_text, write_file_atomic

MAX_PROGRESS_CSV_BYTES = 1 << 30
"""A resumed run's history is read whole; past this the file is refused, not read into memory."""

_KEY = re.compile(r"^[a-z0-9_]+/[A-Za-z0-9_./-]+$")


class MetricsLogger:
    """Write one row per `log(step, metrics)` to `progress.csv` and to every tracker."""

    def __init__(
        self,
        log_dir: str | Path,
        tensorboard: bool = True,
        resumed_at: int | None = None,
        on_row: Callable[[int, Mapping[str, float]], None] | None = None,
        tracking: Tracking | None = None,
    ) -> None:
        """`resumed_at`: the step of the snapshot a resumed run continues from. Rows past it were
        logged after that snapshot by a run that was then killed; the resumed run logs those
        steps again, so they are dropped rather than kept twice. `on_row(step, metrics)` is
        told of every row logged (a supervised run's node reports its progress with it).
        `tracking`: the trackers to open (default: TensorBoard in `log_dir/tb`); `tensorboard`
        False leaves TensorBoard out whatever it says."""
        self.on_row = on_row
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.csv_path = self.log_dir / "progress.csv"
        self._columns: list[str] = ["step"]
        self._rows: list[dict[str, float]] = []
        self._trackers: list[Tracker] = []
        # The CSV first: a refused progress.csv must fail before TensorBoard makes its first file.
        if os.path.lexists(self.csv_path):
            self._load_existing()
            if resumed_at is not None and any(row["step"] > resumed_at for row in self._rows):
                self._rows = [row for row in self._rows if row["step"] <= resumed_at]
                self._rewrite()
        self._trackers = (tracking or Tracking()).open(self.log_dir, tensorboard)

    def _load_existing(self) -> None:
        # A resumed run appends to its own history instead of truncating it.
        text = read_regular_text(self.csv_path, MAX_PROGRESS_CSV_BYTES)
        reader = csv.DictReader(io.StringIO(text, newline=""))
        self._columns = list(reader.fieldnames or ["step"])
        for row in reader:
            self._rows.append({k: float(v) for k, v in row.items() if v not in ("", None)})

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        row: dict[str, float] = {"step": float(step)}
        for key, value in metrics.items():
            if not _KEY.match(key):
                raise RlplexError(f"metric key {key!r} must be namespaced like 'charts/return_mean'")
            row[key] = float(value)
        self.track(step, metrics)
        new_columns = [key for key in row if key not in self._columns]
        self._rows.append(row)
        if self.on_row is not None:
            self.on_row(step, metrics)
        if new_columns or not os.path.lexists(self.csv_path):
            self._columns.extend(new_columns)
            self._rewrite()
        else:
            append_regular_file(self.csv_path, self._csv_text([row], header=False))

    def track(self, step: int, metrics: Mapping[str, float]) -> None:
        """Send a row to the trackers only: one another file already holds (the trainer's rows of
        this run, its held-out evaluations), so that the run's trackers show every metric."""
        if self._trackers and (values := finite(metrics)):
            for tracker in self._trackers:
                tracker.log(step, values)

    def _csv_text(self, rows: Iterable[dict[str, float]], header: bool) -> bytes:
        buffer = io.StringIO(newline="")
        writer = csv.DictWriter(buffer, fieldnames=self._columns)
        if header:
            writer.writeheader()
        writer.writerows(rows)
        return buffer.getvalue().encode("utf-8")

    def _rewrite(self) -> None:
        write_file_atomic(self.csv_path, self._csv_text(self._rows, header=True))

    @property
    def rows(self) -> list[dict[str, float]]:
        return list(self._rows)

    def close(self) -> None:
        close_all(self._trackers)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics_csv(path: str | Path) -> list[dict[str, float]]:
    with Path(path).open(newline="") as handle:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(handle)]
