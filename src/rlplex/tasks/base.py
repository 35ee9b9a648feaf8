"""Toy tasks with exact answers: reverse a word, sort digits, add small numbers.

A reward is the fraction of answer positions right (length mismatches count as wrong
positions), so a partly right answer still carries a learning signal; 1.0 means exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from rlplex.errors import ConfigError


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class Task(Protocol):
    name: str
    max_answer_len: int

    def sample(self, n: int, rng: np.random.Generator) -> list[Problem]: ...

    def reward(self, problem: Problem, completion: str) -> float: ...


def positional_reward(answer: str, completion: str) -> float:
    width = max(len(answer), len(completion))
    if width == 0:
        return 1.0
    right = sum(1 for a, c in zip(answer, completion, strict=False) if a == c)
    return right / width


class ReverseTask:
    name = "reverse"

    def __init__(self, min_len: int = 3, max_len: int = 5, letters: str = "abcdefgh") -> None:
        self.min_len, self.max_len, self.letters = min_len, max_len, letters
        self.max_answer_len = max_len

    def sample(self, n: int, rng: np.random.Generator) -> list[Problem]:
        problems = []
        for _ in range(n):
            word = "".join(rng.choice(list(self.letters), size=int(rng.integers(self.min_len, self.max_len + 1))))
            problems.append(Problem(f"r:{word}>", word[::-1]))
        return problems

    def reward(self, problem: Problem, completion: str) -> float:
        return positional_reward(problem.answer, completion)


class SortDigitsTask:
    name = "sort_digits"

    def __init__(self, min_len: int = 3, max_len: int = 5) -> None:
        self.min_len, self.max_len = min_len, max_len
        self.max_answer_len = max_len

    def sample(self, n: int, rng: np.random.Generator) -> list[Problem]:
        problems = []
        for _ in range(n):
            digits = "".join(
                str(d) for d in rng.integers(0, 10, size=int(rng.integers(self.min_len, self.max_len + 1)))
            )
            problems.append(Problem(f"s:{digits}>", "".join(sorted(digits))))
        return problems

    def reward(self, problem: Problem, completion: str) -> float:
        return positional_reward(problem.answer, completion)


class AdditionTask:
    name = "add"
    max_answer_len = 3

    def __init__(self, max_operand: int = 49) -> None:
        self.max_operand = max_operand

    def sample(self, n: int, rng: np.random.Generator) -> list[Problem]:
        a = rng.integers(0, self.max_operand + 1, size=n)
        b = rng.integers(0, self.max_operand + 1, size=n)
        return [Problem(f"{x}+{y}=", str(x + y)) for x, y in zip(a.tolist(), b.tolist(), strict=True)]

    def reward(self, problem: Problem, completion: str) -> float:
        return positional_reward(problem.answer, completion)


_TASKS = {"reverse": ReverseTask, "sort_digits": SortDigitsTask, "add": AdditionTask}


def task_names() -> list[str]:
    return sorted(_TASKS)


def get_task(name: str) -> Task:
    try:
        return _TASKS[name]()
    except KeyError:
        raise ConfigError(f"field 'task': unknown task {name!r}; known tasks: {', '.join(task_names())}") from None
