"""Partially observed tasks: CartPole-v1 with its velocities hidden.

`rlplex/CartPoleNoVel-v1` observes only the cart position and the pole angle (CartPole's
observation indices 0 and 2), so a policy must infer both velocities from what it has seen:
a feed-forward agent cannot balance for long, a recurrent one can. Episodes, rewards and
the 500-step time limit are CartPole-v1's. Registered when `rlplex.envs` is imported (as
every rlplex process that makes environments does), so `[env] id = "rlplex/CartPoleNoVel-v1"`
works in a TOML file and in sampler worker processes.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

CARTPOLE_NO_VELOCITY = "rlplex/CartPoleNoVel-v1"
_KEPT = np.array([0, 2])  # x, theta (not x_dot, theta_dot)


class HideObservation(gym.ObservationWrapper[np.ndarray, Any, np.ndarray]):
    """Keep only the observation entries `kept` of a Box observation."""

    def __init__(self, env: gym.Env[np.ndarray, Any], kept: np.ndarray) -> None:
        super().__init__(env)
        box = env.observation_space
        assert isinstance(box, gym.spaces.Box)
        self._kept = kept
        self.observation_space = gym.spaces.Box(box.low[kept], box.high[kept], dtype=np.float32)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return np.asarray(observation, dtype=np.float32)[self._kept]


def cartpole_no_velocity(**kwargs: Any) -> gym.Env[np.ndarray, Any]:
    return HideObservation(CartPoleEnv(**kwargs), _KEPT)


def register_partial_envs() -> None:
    if CARTPOLE_NO_VELOCITY not in gym.registry:
        gym.register(
            id=CARTPOLE_NO_VELOCITY, entry_point=cartpole_no_velocity, max_episode_steps=500, reward_threshold=475.0
        )
