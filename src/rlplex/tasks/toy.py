"""Toy environments with exact answers: reverse a word, sort digits, add small numbers.

Raw text prompts for models trained from scratch; the reward is positional (see `positional_match`).
Sampling draws from the rng exactly as the old `Task` classes did, so seeds keep their meaning.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Self

import numpy as np
from pydantic import Field, model_validator

from rlplex.config import StrictModel
from rlplex.tasks.environment import Example, safe_scores
from rlplex.tasks.rewards import positional_match


class _LengthRange(StrictModel):
    min_len: int = Field(3, ge=1, description="shortest string of a prompt")
    max_len: int = Field(5, ge=1, description="longest string of a prompt")

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.min_len > self.max_len:
            raise ValueError(f"min_len ({self.min_len}) is greater than max_len ({self.max_len})")
        return self


class ReverseSettings(_LengthRange):
    letters: str = Field("abcdefgh", min_length=1, description="the letters prompts are drawn from")


class SortDigitsSettings(_LengthRange):
    pass


class AddSettings(StrictModel):
    max_operand: int = Field(49, ge=0, description="largest number added")


class _PositionalScore:
    """The toy tasks' reward: the fraction of answer characters right (`positional_match`)."""

    name: str

    def score(self, examples: Sequence[Example], completions: Sequence[str]) -> list[float]:
        return safe_scores(positional_match, examples, completions, self.name)


class ReverseEnv(_PositionalScore):
    name = "reverse"

    def __init__(self, settings: ReverseSettings | None = None) -> None:
        self.settings = settings or ReverseSettings()
        self.max_new_tokens = self.settings.max_len + 1

    def sample(self, n: int, rng: np.random.Generator) -> list[Example]:
        s, letters = self.settings, list(self.settings.letters)
        examples = []
        for _ in range(n):
            word = "".join(rng.choice(letters, size=int(rng.integers(s.min_len, s.max_len + 1))))
            examples.append(Example(prompt=f"r:{word}>", answer=word[::-1]))
        return examples


class SortDigitsEnv(_PositionalScore):
    name = "sort_digits"

    def __init__(self, settings: SortDigitsSettings | None = None) -> None:
        self.settings = settings or SortDigitsSettings()
        self.max_new_tokens = self.settings.max_len + 1

    def sample(self, n: int, rng: np.random.Generator) -> list[Example]:
        s = self.settings
        examples = []
        for _ in range(n):
            digits = "".join(str(d) for d in rng.integers(0, 10, size=int(rng.integers(s.min_len, s.max_len + 1))))
            examples.append(Example(prompt=f"s:{digits}>", answer="".join(sorted(digits))))
        return examples


class AddEnv(_PositionalScore):
    name = "add"

    def __init__(self, settings: AddSettings | None = None) -> None:
        self.settings = settings or AddSettings()
        self.max_new_tokens = len(str(2 * self.settings.max_operand)) + 1

    def sample(self, n: int, rng: np.random.Generator) -> list[Example]:
        a = rng.integers(0, self.settings.max_operand + 1, size=n)
        b = rng.integers(0, self.settings.max_operand + 1, size=n)
        return [Example(prompt=f"{x}+{y}=", answer=str(x + y)) for x, y in zip(a.tolist(), b.tolist(), strict=True)]
