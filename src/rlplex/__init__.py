"""rlplex: reinforcement-learning training jobs, from CartPole on a laptop to many LLM runs on one trainer."""

from rlplex.errors import RlplexError

__all__ = ["RlplexError"]
__version__ = "0.1.0"
