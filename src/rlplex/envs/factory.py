"""Create gymnasium environments from a small config, and describe their spaces.

Seeds are derived with `numpy.random.SeedSequence` from (seed, rank, worker, env index), so
they are disjoint across ranks, workers and environments (rlpyt's `seed + worker + env`
overlapped: worker 1 env 0 and worker 0 env 1 got the same seed).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Literal

import gymnasium as gym
import numpy as np
from pydantic import Field

from rlplex.config import StrictModel
from rlplex.envs.atari import AtariConfig, EnvMode, make_atari, register_ale
from rlplex.errors import EnvironmentSpecError


class EnvConfig(StrictModel):
    id: str = Field(description="gymnasium environment id, e.g. 'CartPole-v1'")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="passed to gymnasium.make")
    atari: AtariConfig | None = Field(
        None, description="an ALE game ('ALE/Pong-v5') with the standard Atari preprocessing (rlplex.envs.atari)"
    )


@dataclass(frozen=True)
class EnvSpaces:
    """What an agent and a sample buffer need to know of an environment's spaces."""

    obs_shape: tuple[int, ...]
    action_kind: Literal["discrete", "continuous"]
    n_actions: int  # discrete only; 0 for continuous
    action_shape: tuple[int, ...]  # () for discrete
    action_low: tuple[float, ...] = ()
    action_high: tuple[float, ...] = ()
    # uint8 for uint8 Boxes (images: 4x less memory in batches and replay; the model scales
    # them), float32 for every other Box.
    obs_dtype: str = "float32"
    # > 1: observations are stacks of this many frames along axis 0 (FrameStackObservation),
    # a step shifting the stack by one frame; a replay then stores a next observation's newest
    # frame only.
    frame_stack: int = 1

    @property
    def action_dtype(self) -> type[np.generic]:
        return np.int64 if self.action_kind == "discrete" else np.float32


def describe_action_space(spaces: EnvSpaces) -> str:
    """The action space as gymnasium names it, for error messages."""
    if spaces.action_kind == "discrete":
        return f"Discrete({spaces.n_actions})"
    return f"Box(shape={spaces.action_shape}, low={list(spaces.action_low)}, high={list(spaces.action_high)})"


def describe_observation_space(spaces: EnvSpaces) -> str:
    return f"Box(shape={spaces.obs_shape}, dtype={spaces.obs_dtype})"


def make_env(config: EnvConfig, render_mode: str | None = None, mode: EnvMode = "train") -> gym.Env[Any, Any]:
    """The environment `config` names; `mode` 'eval' is the evaluation variant (for Atari: whole
    games with unclipped rewards)."""
    if config.atari is not None or config.id.startswith("ALE/"):
        register_ale()
    try:
        if config.atari is not None:
            return make_atari(config.id, config.kwargs, config.atari, mode, render_mode)
        return gym.make(config.id, render_mode=render_mode, **config.kwargs)
    except gym.error.Error as error:
        known = list(gym.registry.keys())
        close = difflib.get_close_matches(config.id, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise EnvironmentSpecError(f"field 'env.id': cannot make environment {config.id!r}: {error}{hint}") from None
    except TypeError as error:
        raise EnvironmentSpecError(
            f"field 'env.kwargs': environment {config.id!r} rejected {config.kwargs!r}: {error}"
        ) from None


def spaces_of(env: gym.Env[Any, Any]) -> EnvSpaces:
    obs_space = env.observation_space
    if not isinstance(obs_space, gym.spaces.Box):
        raise EnvironmentSpecError(f"observation space {obs_space} is not a Box; rlplex agents need flat arrays")
    act_space = env.action_space
    obs_dtype = "uint8" if obs_space.dtype == np.uint8 else "float32"
    stack = _frame_stack(env)
    if isinstance(act_space, gym.spaces.Discrete):
        return EnvSpaces(
            tuple(obs_space.shape), "discrete", int(act_space.n), (), obs_dtype=obs_dtype, frame_stack=stack
        )
    if isinstance(act_space, gym.spaces.Box):
        return EnvSpaces(
            tuple(obs_space.shape),
            "continuous",
            0,
            tuple(act_space.shape),
            tuple(float(x) for x in np.asarray(act_space.low).ravel()),
            tuple(float(x) for x in np.asarray(act_space.high).ravel()),
            obs_dtype,
            stack,
        )
    raise EnvironmentSpecError(f"action space {act_space} is neither Discrete nor Box")


def _frame_stack(env: gym.Env[Any, Any]) -> int:
    """The stack size of an outermost FrameStackObservation (no wrapper after it changes the
    observations), else 1."""
    if isinstance(env, gym.wrappers.FrameStackObservation):
        return int(env.stack_size)
    return 1


def probe_spaces(config: EnvConfig) -> EnvSpaces:
    env = make_env(config)
    try:
        return spaces_of(env)
    finally:
        env.close()


def env_seed(seed: int, rank: int = 0, worker: int = 0, env_index: int = 0) -> int:
    """A 32-bit seed unique to (seed, rank, worker, env_index)."""
    sequence = np.random.SeedSequence(entropy=seed, spawn_key=(rank, worker, env_index))
    return int(sequence.generate_state(1, dtype=np.uint32)[0])
