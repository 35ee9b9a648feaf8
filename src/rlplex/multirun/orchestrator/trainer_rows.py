"""The trainer's rows of one run, forwarded to the run's trackers by its orchestrator.

The trainer (rank 0) writes one row per step of each run to `logs/trainer_progress.csv` in the
run's folder: loss, grad_norm, lr, stale_dropped, tokens. It serves many runs from one process,
while a run's trackers (one W&B run per rlplex run) are opened by the run's own orchestrator; so
the orchestrator reads the new rows after each step and sends them on (`MetricsLogger.track`),
namespaced `trainer/...`, with the trainer's tokens/s between two rows of the run beside them.
The CSV stays the record; this only copies it to the trackers.
"""

from __future__ import annotations

import csv
import io
import logging
import time
from collections.abc import Callable, Mapping

from rlplex.io.safe_files import read_regular_text
from rlplex.multirun.rundir import RunDir

log = logging.getLogger(__name__)

TRAINER_ROWS = ("logs", "trainer_progress.csv")
MAX_ROWS_BYTES = 256 << 20
# Bookkeeping columns of the trainer's row, not metrics: the slot is where the run sits.
_NOT_METRICS = frozenset({"step", "slot", "time"})


class TrainerRows:
    """Forward each row of the trainer's log for this run once, in step order."""

    def __init__(self, run: RunDir, after_step: int = 0) -> None:
        """`after_step`: rows up to it were forwarded before (a restarted orchestrator resumes)."""
        self.run = run
        self.forwarded = after_step
        self._last: Mapping[str, float] | None = None

    def read(self) -> list[dict[str, float]]:
        """The complete rows written so far (a last line still being written is left for later)."""
        path = self.run.root.joinpath(*TRAINER_ROWS)
        try:
            text = read_regular_text(path, MAX_ROWS_BYTES, within=self.run.root)
        except FileNotFoundError:
            return []
        except OSError as error:  # a link or a FIFO planted there: the CSV's readers refuse it too
            log.warning("run %s: trainer rows not forwarded: %s", self.run.run_id, error)
            return []
        rows = []
        for raw in csv.DictReader(io.StringIO(text[: text.rfind("\n") + 1])):
            try:
                rows.append({k: float(v) for k, v in raw.items() if k and v not in ("", None)})
            except (TypeError, ValueError):
                continue
        return rows

    def forward(self, track: Callable[[int, Mapping[str, float]], None]) -> int:
        """Send the rows not sent yet; returns the newest step sent."""
        for row in self.read():
            step = int(row.get("step", 0))
            if step <= self.forwarded:
                self._last = row
                continue
            metrics = {f"trainer/{k}": v for k, v in row.items() if k not in _NOT_METRICS}
            last = self._last
            if last is not None and "time" in row and "time" in last and row["time"] > last["time"]:
                tokens = row.get("total_tokens", 0.0) - last.get("total_tokens", 0.0)
                metrics["trainer/tokens_per_s"] = tokens / (row["time"] - last["time"])
            track(step, metrics)
            self.forwarded, self._last = step, row
        return self.forwarded

    def forward_until(
        self, track: Callable[[int, Mapping[str, float]], None], step: int, timeout_s: float, poll_s: float = 0.2
    ) -> bool:
        """Forward rows until the one of `step` is sent or `timeout_s` passes: the trainer writes a
        step's row just after its broadcast, which is what the orchestrator waits for."""
        deadline = time.monotonic() + timeout_s
        while self.forward(track) < step:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True
