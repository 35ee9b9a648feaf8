"""Elapsed time and ETA of the main job's runs, from the trainer's per-step progress rows.

A run's pace is its time per step: the median of its step durations over the newest
`ETA_WINDOW_STEPS` steps. The median, not the mean, so that one long gap (a master restart, a
slow checkpoint, a resumed job's downtime) does not set the pace for the next ten steps. The
ETA counts down from the newest step: the run should finish `remaining × time per step` after
it; a step that is overdue is taken as under way, so the ETA never claims less than the steps
after it. Unknown (None, shown "—") until the run has trained a step.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

ETA_WINDOW_STEPS = 10
UNKNOWN = "—"


def step_history(rows: Iterable[Mapping[str, float]]) -> list[tuple[int, float]]:
    """(step, wall time) of each trained step, oldest first. A trainer resumed from an older
    checkpoint trains some steps again: their newer rows replace the older ones."""
    history: list[tuple[int, float]] = []
    for row in rows:
        if "step" not in row or "time" not in row:
            continue
        step = int(row["step"])
        while history and history[-1][0] >= step:
            history.pop()
        history.append((step, row["time"]))
    return history


def seconds_per_step(history: list[tuple[int, float]], started_at: float | None = None) -> float | None:
    """The run's time per step over its newest `ETA_WINDOW_STEPS` steps (None: unknown). With a
    single step trained, that step's time since the run started (its folder was made)."""
    window = history[-(ETA_WINDOW_STEPS + 1) :]
    durations = sorted((t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in itertools.pairwise(window) if t1 >= t0)
    if durations:
        middle = len(durations) // 2
        return durations[middle] if len(durations) % 2 else (durations[middle - 1] + durations[middle]) / 2
    if len(history) == 1 and started_at is not None and history[0][0] > 0 and history[0][1] > started_at:
        return (history[0][1] - started_at) / history[0][0]
    return None


def eta_s(
    history: list[tuple[int, float]], max_steps: int, clock: float, started_at: float | None = None
) -> float | None:
    """Seconds until the run trains its `max_steps`-th step, seen at wall time `clock`."""
    pace = seconds_per_step(history, started_at)
    if pace is None or max_steps <= 0:
        return None
    step, at = history[-1]
    remaining = max(0, max_steps - step)
    if remaining == 0:
        return 0.0
    return max(at + remaining * pace - clock, (remaining - 1) * pace, 0.0)


def job_eta_s(unfinished: Iterable[float | None]) -> float | None:
    """The job's ETA: its slowest unfinished run's (None when one of them is unknown)."""
    etas = list(unfinished)
    if any(eta is None for eta in etas):
        return None
    return max((eta for eta in etas if eta is not None), default=0.0)


def format_duration(seconds: float | None) -> str:
    """Seconds as 42s, 3m05s, 1h02m or 2d03h; "—" when unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return UNKNOWN
    whole = int(seconds + 0.5)
    minutes, secs = divmod(whole, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"
