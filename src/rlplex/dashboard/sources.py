"""Where the dashboard's `JobView` comes from, and how often it is read.

Three kinds of folder, told apart by their files:

| kind  | marker                          | read with                                         |
| ----- | ------------------------------- | ------------------------------------------------- |
| main  | `main_job.json` or `runs.json`  | `collect()`, as the live view and `rlplex status` |
| job   | `job.sqlite` alone (`job run`)  | `collect()`: its nodes and event log, no runs     |
| train | `progress.csv` (`rlplex train`) | `classic_view()`: one run (nodes: `--supervise`)  |

`ViewSource` reads the folder at most once per `min_interval_s` whatever the number of open
pages: a request inside that interval gets the view read last. A job's master that serves the
dashboard itself hands it each view its own loop collected (`publish`), so the folder is not
read a second time.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from rlplex.control.job.store import STORE_FILE
from rlplex.io.safe_files import read_regular_text
from rlplex.mainjob.config import JOB_CONFIG_FILE
from rlplex.mainjob.progress_rows import read_progress_rows
from rlplex.mainjob.registry import REGISTRY_FILE
from rlplex.mainjob.view import JobView, RunView, collect

EVENTS = 200  # the newest transitions and decisions the page lists
CLASSIC_RETURN = "charts/online_return_mean"
CLASSIC_EVAL = "charts/eval_return_mean"
# A classic run whose progress.csv was written this recently is taken as still running.
CLASSIC_QUIET_S = 120.0


def folder_kind(output_dir: Path) -> str:
    if (output_dir / JOB_CONFIG_FILE).exists() or (output_dir / REGISTRY_FILE).exists():
        return "main"
    if (output_dir / "progress.csv").exists():
        return "train"
    if (output_dir / STORE_FILE).exists():
        return "job"
    return "unknown"


def classic_view(output_dir: Path) -> JobView:
    """A classic-RL run as a job of one run: its return curve, evaluations and settings."""
    view = collect(output_dir, events=EVENTS) if (output_dir / STORE_FILE).exists() else None
    rows = read_progress_rows(output_dir / "progress.csv")
    try:
        settings = json.loads(read_regular_text(output_dir / "config.json"))
    except (OSError, ValueError):
        settings = {}
    runner = settings.get("runner", {}) if isinstance(settings, dict) else {}
    last = rows[-1] if rows else {}
    try:
        written = (output_dir / "progress.csv").stat().st_mtime
    except OSError:
        written = None
    run = RunView(
        output_dir.name or "run",
        "running" if written is not None and time.time() - written < CLASSIC_QUIET_S else "quiet",
        int(last.get("step", 0)),
        int(runner.get("n_steps", 0)) if isinstance(runner, dict) else 0,
        reward=last.get(CLASSIC_RETURN),
        tokens_per_s=last.get("charts/env_steps_per_s"),
        curve=[(row["step"], row[CLASSIC_RETURN]) for row in rows if "step" in row and CLASSIC_RETURN in row],
        evaluations=[{"step": row["step"], "eval/return": row[CLASSIC_EVAL]} for row in rows if CLASSIC_EVAL in row],
        settings=settings if isinstance(settings, dict) else {},
        started_at=rows[0].get("time") if rows else None,
    )
    if view is None:
        return JobView(output_dir, "UNKNOWN", "", [], [run], time.time())
    view.runs = [run]
    return view


class ViewSource:
    """The newest `JobView` of one folder, read at most once per `min_interval_s` (thread-safe)."""

    def __init__(self, output_dir: Path, min_interval_s: float = 0.5, reads_folder: bool = True) -> None:
        self.output_dir = output_dir
        self.kind = folder_kind(output_dir)
        self.min_interval_s = min_interval_s
        self.reads_folder = reads_folder  # False: views come from `publish` alone (a master's own loop)
        self._view: JobView | None = None
        self._at = 0.0
        self._lock = threading.Lock()

    def publish(self, view: JobView) -> None:
        with self._lock:
            self._view, self._at = view, time.monotonic()

    def read(self) -> JobView:
        """The view read within the last `min_interval_s`, or a fresh one (blocking: call it off
        the event loop)."""
        with self._lock:
            fresh = self._view is not None and time.monotonic() - self._at < self.min_interval_s
            if self._view is not None and (fresh or not self.reads_folder):
                return self._view
            if self.kind == "unknown":  # the job may not have written its files yet
                self.kind = folder_kind(self.output_dir)
            view = classic_view(self.output_dir) if self.kind == "train" else collect(self.output_dir, events=EVENTS)
            self._view, self._at = view, time.monotonic()
            return view
