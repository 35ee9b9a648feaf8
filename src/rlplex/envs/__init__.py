"""Gymnasium environments: creation with clear errors, space descriptions, disjoint seeds."""

from rlplex.envs.atari import AtariConfig
from rlplex.envs.factory import (
    EnvConfig,
    EnvSpaces,
    describe_action_space,
    describe_observation_space,
    env_seed,
    make_env,
    probe_spaces,
)
from rlplex.envs.partial import CARTPOLE_NO_VELOCITY, register_partial_envs

register_partial_envs()

__all__ = [
    "CARTPOLE_NO_VELOCITY",
    "AtariConfig",
    "EnvConfig",
    "EnvSpaces",
    "describe_action_space",
    "describe_observation_space",
    "env_seed",
    "make_env",
    "probe_spaces",
]
