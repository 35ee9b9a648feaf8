"""What an environment for language-model RL is: examples to prompt with, and a reward to score completions.

An `Example` carries either a raw text prompt (completion-style tasks, tokenised as is) or a chat
message list (rendered with the tokenizer's chat template by the caller). Messages are the shape
multi-turn environments will extend: a later turn appends to them, the single-turn API stays.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from rlplex.errors import ConfigError, RlplexError
from rlplex.tasks.reward_guard import RowFailure, guarded_outcomes

log = logging.getLogger(__name__)

Message = dict[str, str]
RewardFn = Callable[[str, str, str], float]

ROLES = ("system", "user", "assistant")
# Enough rows for a user to find the pattern; the rest are counted, so one bad batch is one readable line.
_FAILURES_SHOWN = 5


def as_messages(value: object) -> tuple[Message, ...]:
    """Check a chat message list and copy it into a tuple of plain dicts; raises `ConfigError` saying what is wrong.

    Keys whose value is None are dropped: Arrow (under `datasets`) gives every message of a column the
    union of all messages' keys, filling the ones a message lacks with None.
    """
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ConfigError(f"expected a list of messages, got {value!r:.80}")
    if not value:
        raise ConfigError("the message list is empty")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise ConfigError(f"message {i}: expected a mapping with 'role' and 'content', got {message!r:.80}")
        kept = {key: item for key, item in message.items() if item is not None}
        for key in ("role", "content"):
            if not isinstance(kept.get(key), str):
                raise ConfigError(f"message {i}: {key!r} must be a string (got {kept.get(key)!r:.80})")
        if kept["role"] not in ROLES:
            raise ConfigError(f"message {i}: unknown role {kept['role']!r}; known roles: {', '.join(ROLES)}")
        if not all(isinstance(key, str) and isinstance(item, str) for key, item in kept.items()):
            raise ConfigError(f"message {i}: every key and value must be a string (got {message!r:.80})")
        messages.append(kept)
    if not any(message["role"] == "user" for message in messages):
        raise ConfigError("the message list has no 'user' message")
    return tuple(messages)


@dataclass(frozen=True)
class Example:
    """One prompt and its reference answer. Exactly one of `prompt` and `messages` is given."""

    answer: str
    prompt: str | None = None
    messages: tuple[Message, ...] | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ConfigError("Example: give exactly one of 'prompt' and 'messages'")
        if not isinstance(self.answer, str):
            raise ConfigError(f"Example: field 'answer' must be a string (got {self.answer!r:.80})")
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ConfigError(f"Example: field 'prompt' must be a string (got {self.prompt!r:.80})")
        if self.messages is not None:
            try:
                messages = as_messages(self.messages)
            except ConfigError as error:
                raise ConfigError(f"Example: field 'messages': {error}") from None
            # A private copy: the caller's list must not change a frozen example behind its back.
            object.__setattr__(self, "messages", messages)

    @property
    def prompt_text(self) -> str:
        """The text a reward function sees: the raw prompt, or the last user message's content."""
        if self.prompt is not None:
            return self.prompt
        assert self.messages is not None  # __post_init__ guarantees one of the two
        return next(m["content"] for m in reversed(self.messages) if m["role"] == "user")


class Environment(Protocol):
    name: str
    max_new_tokens: int  # generation length that fits every answer, plus one for EOS

    def sample(self, n: int, rng: np.random.Generator) -> list[Example]: ...

    def score(self, examples: Sequence[Example], completions: Sequence[str]) -> list[float]: ...


class Rubric:
    """Several reward functions as one: the weighted sum of their rewards."""

    def __init__(self, functions: Sequence[tuple[RewardFn, float]]) -> None:
        if not functions:
            raise ConfigError("Rubric: give at least one (reward function, weight) pair")
        for i, (function, weight) in enumerate(functions):
            if not callable(function):
                raise ConfigError(f"Rubric: function {i} is not callable (got {function!r:.80})")
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
                raise ConfigError(f"Rubric: weight {i} must be a finite number (got {weight!r})")
        self.functions = tuple((function, float(weight)) for function, weight in functions)

    def __call__(self, prompt: str, completion: str, answer: str) -> float:
        return sum(weight * function(prompt, completion, answer) for function, weight in self.functions)


def safe_scores(
    reward: RewardFn, examples: Sequence[Example], completions: Sequence[str], env_name: str
) -> list[float]:
    """Score each completion; a sample whose reward raises, is not a finite number or runs past
    its deadline (`rlplex.tasks.reward_guard`: each call runs in a child process) scores 0.0.

    One bad sample (a user's reward tripping on odd model output) must not take a run down, and a
    batch of them must not flood the log: all of one call's failures go into one warning.
    """
    if len(examples) != len(completions):
        # A caller's bug, not a reward's: scores paired with the wrong samples would train silently wrong.
        raise RlplexError(f"environment {env_name!r}: {len(examples)} examples but {len(completions)} completions")
    rows = [(e.prompt_text, c, e.answer) for e, c in zip(examples, completions, strict=True)]
    scores: list[float] = []
    failures: list[str] = []
    for row, outcome in enumerate(guarded_outcomes(reward, rows)):
        if isinstance(outcome, RowFailure):
            failures.append(f"row {row}: {outcome.text}")
            scores.append(0.0)
        else:
            scores.append(outcome)
    if failures:
        more = len(failures) - _FAILURES_SHOWN
        shown = "; ".join(failures[:_FAILURES_SHOWN]) + (f"; and {more} more" if more > 0 else "")
        log.warning(
            "environment %r: reward failed on %d of %d samples, scored 0.0: %s",
            env_name,
            len(failures),
            len(scores),
            shown,
        )
    return scores
