"""The main job's progress as plain lines, for when there is no live view (`--no-live`, or output
to a file or pipe: nohup, Slurm, CI): one line per active run every `print_every_s` seconds
and one whenever a run changes state, from the same `JobView` the live table draws.

```
[  2m10s] run_fast     running   step 7/12  reward 0.712  tokens/s 1830  ETA 1m05s
[  2m31s] run_fast     finished  step 12/12  reward 0.744  tokens/s 1795  ETA done
```
"""

from __future__ import annotations

import math

from rlplex.mainjob.timing import format_duration
from rlplex.mainjob.view import ACTIVE_RUN_STATES, JobView, RunView


class ProgressLines:
    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._next = 0.0
        self._states: dict[str, str] = {}

    def due(self, now: float) -> bool:
        return now >= self._next

    def lines(self, view: JobView, now: float) -> list[str]:
        """The lines to print at `now` (monotonic seconds): every active run's when the period
        has come, and each run whose state changed since the last call."""
        due = self.due(now)
        if due:
            self._next = now + self.every_s
        out = []
        for run in view.runs:
            changed = self._states.get(run.run_id) != run.state
            self._states[run.run_id] = run.state
            if changed or (due and run.state in ACTIVE_RUN_STATES):
                out.append(run_line(view, run))
        return out


def run_line(view: JobView, run: RunView) -> str:
    eta = "done" if run.state == "finished" else format_duration(view.run_eta_s(run))
    parts = [
        f"[{format_duration(view.elapsed_s):>7}] {run.run_id:<12} {run.state:<9}",
        f"step {run.trained_steps}/{run.max_steps}",
        f"reward {_num(run.reward, '.3f')}",
        *([f"held-out {_num(run.heldout, '.3f')}"] if run.heldout is not None else []),
        f"tokens/s {_num(run.tokens_per_s, '.0f')}",
        f"ETA {eta}",
    ]
    if run.reason and run.state in ("evicted", "rejected"):
        parts.append(run.reason)
    elif run.doing and run.state in ACTIVE_RUN_STATES:
        parts.append(run.doing)
    return "  ".join(parts)


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)
