"""Environments for language-model RL: examples to prompt with (generated, or a user's file) and a reward.

`load_environment({"name": ..., **settings})` builds one by name; `Environment` is what the rest of
rlplex samples from and scores with.
"""

from rlplex.tasks.environment import Environment, Example, Message, RewardFn, Rubric, safe_scores
from rlplex.tasks.registry import EnvSpec, environment_names, load_environment

__all__ = [
    "EnvSpec",
    "Environment",
    "Example",
    "Message",
    "RewardFn",
    "Rubric",
    "environment_names",
    "load_environment",
    "safe_scores",
]
