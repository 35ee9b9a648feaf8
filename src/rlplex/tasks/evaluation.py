"""Scoring an evaluation: accuracy and mean reward of completions on a fixed set of examples.

Shared by every place that evaluates (`rlplex.models.lm.evaluate` in process, the main job's
orchestrators through their inference engine), so "accuracy" means one thing everywhere: the
environment's own `correct()` where it has one (right answers, format rewards aside), else a
full reward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rlplex.tasks.environment import Environment, Example


@dataclass(frozen=True)
class Evaluation:
    """A model's score on a fixed set of examples."""

    accuracy: float  # share of right answers
    reward: float  # mean reward, as training sees it (format terms included)
    n: int
    temperature: float


def score_evaluation(
    environment: Environment, examples: Sequence[Example], completions: Sequence[str], temperature: float
) -> Evaluation:
    rewards = environment.score(examples, completions)
    correct = getattr(environment, "correct", None)
    right = correct(examples, completions) if callable(correct) else [float(r >= 1.0) for r in rewards]
    n = max(len(examples), 1)
    return Evaluation(sum(right) / n, sum(rewards) / n, len(examples), temperature)


__all__ = ["Evaluation", "score_evaluation"]
