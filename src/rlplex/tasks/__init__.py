"""Verifiable toy tasks for language-model RL: generated on the fly, scored by a program."""

from rlplex.tasks.base import Problem, Task, get_task, task_names
from rlplex.tasks.tokenizer import CharTokenizer

__all__ = ["CharTokenizer", "Problem", "Task", "get_task", "task_names"]
