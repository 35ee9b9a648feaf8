"""Environments for language-model RL: examples to prompt with (generated, or a user's file) and a reward.

`load_environment({"name": ..., **settings})` builds one by name; `Environment` is what the rest of
rlplex samples from and scores with. `Task`, `Problem`, `get_task`, `task_names` and `CharTokenizer`
are the older toy-task API, kept until their callers move over.
"""

from rlplex.tasks.base import Problem, Task, get_task, task_names
from rlplex.tasks.environment import Environment, Example, Message, RewardFn, Rubric, safe_scores
from rlplex.tasks.registry import EnvSpec, environment_names, load_environment
from rlplex.tasks.tokenizer import CharTokenizer

__all__ = [
    "CharTokenizer",
    "EnvSpec",
    "Environment",
    "Example",
    "Message",
    "Problem",
    "RewardFn",
    "Rubric",
    "Task",
    "environment_names",
    "get_task",
    "load_environment",
    "safe_scores",
    "task_names",
]
