"""Gymnasium environments: creation with clear errors, space descriptions, disjoint seeds."""

from rlplex.envs.factory import EnvConfig, EnvSpaces, describe_action_space, env_seed, make_env, probe_spaces

__all__ = ["EnvConfig", "EnvSpaces", "describe_action_space", "env_seed", "make_env", "probe_spaces"]
