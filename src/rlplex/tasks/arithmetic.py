"""Arithmetic word problems, generated on the fly as chat prompts, checked by math-verify.

"Tom has 3 apples and buys 5 more. How many apples does Tom have now?" -> "8". Operands start at 2
so every count reads as a plural ("1 apples" would teach the model bad English, not arithmetic),
and a subtraction takes the smaller operand from the larger, so no answer is negative.

Difficulty is graded by `steps`: a problem of 2 or 3 steps chains that many operations on one
count ("Ana has 7 marbles. She buys 4 more, then gives 3 to a friend. How many ..."); a list of
steps mixes the grades. `heldout_fraction` sets aside a seeded share of the problems (by their
numbers and operations, whatever the names and wording): `split = "train"` never draws them and
`split = "heldout"` draws only them, so an evaluation measures problems no run trained on.
`answer_format` asks for the result after "Answer:", and `format_weight` adds that much reward
for a reply that ends so; correctness alone is `correct()`, what evaluations report.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from rlplex.config import StrictModel
from rlplex.errors import ConfigError
from rlplex.tasks.environment import Example, safe_scores
from rlplex.tasks.rewards import math_answer

Operation = Literal["add", "subtract", "multiply"]
Split = Literal["all", "train", "heldout"]
ANSWER_MARKER = "Answer:"
ANSWER_INSTRUCTION = "Give the final answer as a number after 'Answer:'."

_TEMPLATES: dict[str, tuple[str, ...]] = {
    "add": (
        "{name} has {a} {items} and buys {b} more. How many {items} does {name} have now?",
        "There are {a} {items} in a basket. {name} puts in {b} more. How many {items} are in the basket now?",
    ),
    "subtract": (
        "{name} has {a} {items} and gives {b} of them to a friend. How many {items} does {name} have left?",
        "A box holds {a} {items}. {name} takes out {b}. How many {items} are left in the box?",
    ),
    "multiply": (
        "{name} has {a} bags with {b} {items} in each bag. How many {items} does {name} have in total?",
        "A shelf has {a} rows of {b} {items} each. How many {items} are on the shelf?",
    ),
}
# The later steps of a chained problem: what happens to the count, and the operand's range.
_STEP_TEXT: dict[str, str] = {
    "add": "buys {b} more",
    "subtract": "gives {b} to a friend",
    "multiply": "ends up with {b} times as many",
}
_NAMES = ("Tom", "Ana", "Li", "Sam", "Maya", "Omar", "Eva", "Raj")
_ITEMS = ("apples", "pencils", "marbles", "books", "cookies", "stickers")
_MAX_DRAWS = 10_000  # rejection sampling of a split; a share that small is a settings error
_FINAL_ANSWER = re.compile(rf"{ANSWER_MARKER}\s*\$?(-?\d+(?:\.\d+)?)\$?\s*\.?\s*$")


class ArithmeticSettings(StrictModel):
    max_operand: int = Field(20, ge=2, description="largest number in a problem")
    operations: tuple[Operation, ...] = Field(
        ("add", "subtract"), min_length=1, description="the operations problems use (add, subtract, multiply)"
    )
    steps: tuple[int, ...] = Field(
        (1,), min_length=1, description="operations per problem (1 to 3); several: a mix of grades, drawn evenly"
    )
    system_prompt: str | None = Field(None, description="a system message before each problem; None: none")
    answer_format: bool = Field(False, description=f"end the question with: {ANSWER_INSTRUCTION}")
    format_weight: float = Field(0.0, ge=0, description="extra reward for a reply that ends 'Answer: <number>'")
    split: Split = Field("all", description="all, train (never the held-out share) or heldout (only it)")
    heldout_fraction: float = Field(0.0, ge=0, lt=1, description="share of problems kept for evaluation")
    max_new_tokens: int = Field(16, ge=1, description="generation length of a reply")

    def model_post_init(self, context: object) -> None:
        if any(not 1 <= s <= 3 for s in self.steps):
            raise ValueError(f"steps must each be 1, 2 or 3 (got {list(self.steps)})")
        if self.split != "all" and self.heldout_fraction == 0:
            raise ValueError(f"split = {self.split!r} needs a heldout_fraction above 0")


def heldout(key: str, fraction: float) -> bool:
    """Whether the problem `key` (its operations and numbers) is in the held-out share: a hash,
    so every process and every seed agrees."""
    value = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    return value / 2**64 < fraction


def final_answer(completion: str) -> str:
    """The part of a reply that holds its answer: after the last 'Answer:' when there is one."""
    _before, marker, after = completion.rpartition(ANSWER_MARKER)
    return after if marker else completion


def arithmetic_answer(prompt: str, completion: str, answer: str) -> float:
    """1.0 when math-verify judges the reply's final answer (`final_answer`) equal to the reference."""
    return math_answer(prompt, final_answer(completion), answer)


def answer_formatted(completion: str) -> bool:
    """The reply ends with 'Answer: <number>' (a closing period or $..$ allowed)."""
    return _FINAL_ANSWER.search(completion.strip()) is not None


class ArithmeticEnv:
    name = "arithmetic"

    def __init__(self, settings: ArithmeticSettings | None = None) -> None:
        self.settings = settings or ArithmeticSettings()
        self.max_new_tokens = self.settings.max_new_tokens

    def sample(self, n: int, rng: np.random.Generator) -> list[Example]:
        return [self._draw(rng) for _ in range(n)]

    def _draw(self, rng: np.random.Generator) -> Example:
        s = self.settings
        for _ in range(_MAX_DRAWS):
            example, key = self._problem(rng)
            if s.split == "all" or heldout(key, s.heldout_fraction) == (s.split == "heldout"):
                return example
        raise ConfigError(f"env 'arithmetic': no {s.split} problem in {_MAX_DRAWS} draws; raise heldout_fraction")

    def _problem(self, rng: np.random.Generator) -> tuple[Example, str]:
        s = self.settings
        steps = s.steps[int(rng.integers(len(s.steps)))] if len(s.steps) > 1 else s.steps[0]
        if steps == 1:
            text, key, result = self._one_step(rng)
        else:
            text, key, result = self._chain(rng, steps)
        if s.answer_format:
            text = f"{text} {ANSWER_INSTRUCTION}"
        system = () if s.system_prompt is None else ({"role": "system", "content": s.system_prompt},)
        return Example(messages=(*system, {"role": "user", "content": text}), answer=str(result)), key

    def _one_step(self, rng: np.random.Generator) -> tuple[str, str, int]:
        # The draws of rlplex's first arithmetic task, in its order: seeds keep their problems.
        s = self.settings
        operation = s.operations[int(rng.integers(len(s.operations)))]
        templates = _TEMPLATES[operation]
        template = templates[int(rng.integers(len(templates)))]
        x, y = (int(v) for v in rng.integers(2, s.max_operand + 1, size=2))
        if operation == "add":
            a, b, result = x, y, x + y
        elif operation == "subtract":
            a, b = max(x, y), min(x, y)
            result = a - b
        else:
            a, b, result = x, y, x * y
        text = template.format(
            name=_NAMES[int(rng.integers(len(_NAMES)))], items=_ITEMS[int(rng.integers(len(_ITEMS)))], a=a, b=b
        )
        return text, f"{operation} {a} {b}", result

    def _chain(self, rng: np.random.Generator, steps: int) -> tuple[str, str, int]:
        s = self.settings
        name, items = _NAMES[int(rng.integers(len(_NAMES)))], _ITEMS[int(rng.integers(len(_ITEMS)))]
        count = int(rng.integers(2, s.max_operand + 1))
        key, actions = [str(count)], []
        for _ in range(steps):
            operation = s.operations[int(rng.integers(len(s.operations)))]
            if operation == "subtract" and count < 3:
                operation = "add"  # nothing left to give: the count stays positive
            if operation == "multiply":
                b = int(rng.integers(2, 4))  # twice or three times: the numbers stay readable
                count *= b
            elif operation == "subtract":
                b = int(rng.integers(1, min(count, s.max_operand + 1)))
                count -= b
            else:
                b = int(rng.integers(2, s.max_operand + 1))
                count += b
            actions.append(_STEP_TEXT[operation].format(b=b))
            key.append(f"{operation} {b}")
        story = ", then ".join(actions[:-1]) + f" and then {actions[-1]}"
        text = f"{name} has {key[0]} {items}. {name} {story}. How many {items} does {name} have now?"
        return text, " ".join(key), count

    def correct(self, examples: Sequence[Example], completions: Sequence[str]) -> list[float]:
        """1.0 per right final answer, format aside: the accuracy an evaluation reports."""
        return safe_scores(arithmetic_answer, examples, completions, self.name)

    def score(self, examples: Sequence[Example], completions: Sequence[str]) -> list[float]:
        scores = self.correct(examples, completions)
        weight = self.settings.format_weight
        if weight == 0:
            return scores
        return [score + weight * answer_formatted(c) for score, c in zip(scores, completions, strict=True)]
