"""Agents: a model plus how to act with it (sampling, deterministic evaluation)."""

from rlplex.agents.base import Agent, AgentFactory
from rlplex.agents.ddpg import DdpgAgent
from rlplex.agents.dqn import DqnAgent
from rlplex.agents.pg import CategoricalPgAgent, GaussianPgAgent, PgAgent
from rlplex.agents.random import RandomAgent
from rlplex.agents.sac import SacAgent

__all__ = [
    "Agent",
    "AgentFactory",
    "CategoricalPgAgent",
    "DdpgAgent",
    "DqnAgent",
    "GaussianPgAgent",
    "PgAgent",
    "RandomAgent",
    "SacAgent",
]
