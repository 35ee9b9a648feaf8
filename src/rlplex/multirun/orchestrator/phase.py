"""What an orchestrator is doing now, for the people watching: reported as two numbers (its
phase and the step it is at) through whatever carries its progress (a job node's heartbeat
counters), and said in words by the main job's view and lines. Without it a run shows
"running, step 0, reward -" for the minute its model takes to load."""

from __future__ import annotations

from collections.abc import Callable
from enum import IntEnum


class Phase(IntEnum):
    PREPARING = 1  # loading the model (engine hf) or reaching the job's inference servers (vllm)
    WAITING = 2  # for the trainer's adapter that the step samples with
    GENERATING = 3
    EVALUATING = 4
    FINISHING = 5  # every step written: waiting for the trainer to train the last


PhaseReport = Callable[[Phase, int], None]


def describe(phase: float, step: float, engine: str = "hf") -> str:
    """`phase` and `step` as the view shows them ("" for a value no orchestrator reports)."""
    step_n = int(step)
    words = {
        Phase.PREPARING: "loading the model" if engine == "hf" else "reaching the inference servers",
        Phase.WAITING: f"waiting for the trainer's adapter (step {step_n})",
        Phase.GENERATING: f"generating step {step_n}",
        Phase.EVALUATING: f"evaluating policy step {step_n}",
        Phase.FINISHING: "waiting for the trainer's last step",
    }
    try:
        return words[Phase(int(phase))]
    except ValueError:
        return ""


def ignore(phase: Phase, step: int) -> None:
    """The report of an orchestrator that nobody watches (standalone, tests)."""
