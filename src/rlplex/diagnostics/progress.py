"""A one-line live status for long work, drawn with rich.

It redraws in place on a terminal and falls back to a plain line every `plain_every`
updates when output is not a terminal (CI logs), so progress is visible in both.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class ProgressLine:
    def __init__(self, total: int, description: str, enabled: bool = True, plain_every_s: float = 10.0) -> None:
        self.total = total
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
            print(f"[{self._description}] {completed:,}/{self.total:,} {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
