"""A one-line live status for long work, drawn with rich.

It redraws in place on a terminal. When output is not a terminal (nohup, Slurm, CI logs) it
prints a plain line at each update instead, i.e. at each log interval of a runner, as SB3 and
TRL do: done/total, elapsed, ETA and the status metrics. Lines come at most every
`plain_every_s` seconds (a runner logging many times a second would flood the log; its rows
are all in progress.csv), and the last one always.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class ProgressLine:
    def __init__(
        self, total: int, description: str, enabled: bool = True, plain_every_s: float = 1.0, initial: int = 0
    ) -> None:
        """`initial`: what was done before (a resumed run): the ETA's pace counts only what this
        process did, since it started."""
        self.total = total
        self._started = time.monotonic()
        self._initial = initial
        self.enabled = enabled
        self._console = Console(stderr=True)
        self._live = enabled and self._console.is_terminal
        self._plain_every_s = plain_every_s
        self._last_plain = 0.0
        self._description = description
        self._progress: Progress | None = None
        if self._live:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.completed:,}/{task.total:,}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"),
                console=self._console,
                transient=False,
            )
            self._task = self._progress.add_task(description, total=total, status="")
            self._progress.start()

    def update(self, completed: int, status: Mapping[str, float] | None = None) -> None:
        if not self.enabled:
            return
        text = "  ".join(f"{k.split('/')[-1]}={v:.4g}" for k, v in (status or {}).items())
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, status=text)
            return
        now = time.monotonic()
        if now - self._last_plain >= self._plain_every_s or completed >= self.total:
            self._last_plain = now
            print(self.plain_line(completed, text, now), file=sys.stderr, flush=True)

    def plain_line(self, completed: int, status: str, now: float) -> str:
        elapsed = now - self._started
        done_here = completed - self._initial
        eta = (self.total - completed) * elapsed / done_here if done_here > 0 else None
        percent = 100 * completed / self.total if self.total else 100.0
        when = f"elapsed {_clock(elapsed)} ETA {_clock(eta) if eta is not None else '?'}"
        return f"[{self._description}] {completed:,}/{self.total:,} ({percent:.0f}%) {when}  {status}".rstrip()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
