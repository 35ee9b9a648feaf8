"""Arithmetic word problems, generated on the fly as chat prompts, checked by math-verify.

"Tom has 3 apples and buys 5 more. How many apples does Tom have now?" -> "8". Operands start at 2
so every count reads as a plural ("1 apples" would teach the model bad English, not arithmetic),
and a subtraction takes the smaller operand from the larger, so no answer is negative.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from rlplex.config import StrictModel
from rlplex.tasks.environment import Example, safe_scores
from rlplex.tasks.rewards import math_answer

Operation = Literal["add", "subtract", "multiply"]

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
_NAMES = ("Tom", "Ana", "Li", "Sam", "Maya", "Omar", "Eva", "Raj")
_ITEMS = ("apples", "pencils", "marbles", "books", "cookies", "stickers")


class ArithmeticSettings(StrictModel):
    max_operand: int = Field(20, ge=2)
    operations: tuple[Operation, ...] = Field(("add", "subtract"), min_length=1)
    system_prompt: str | None = None
    max_new_tokens: int = Field(16, ge=1)


class ArithmeticEnv:
    name = "arithmetic"

    def __init__(self, settings: ArithmeticSettings | None = None) -> None:
        self.settings = settings or ArithmeticSettings()
        self.max_new_tokens = self.settings.max_new_tokens

    def sample(self, n: int, rng: np.random.Generator) -> list[Example]:
        return [self._problem(rng) for _ in range(n)]

    def _problem(self, rng: np.random.Generator) -> Example:
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
        system = () if s.system_prompt is None else ({"role": "system", "content": s.system_prompt},)
        return Example(messages=(*system, {"role": "user", "content": text}), answer=str(result))

    def score(self, examples: Sequence[Example], completions: Sequence[str]) -> list[float]:
        return safe_scores(math_answer, examples, completions, self.name)
