"""The SAC agent: a tanh-squashed Gaussian policy over a Box action space.

Before learning starts (the actor's `random_actions` buffer, set by the algorithm) it acts
uniformly at random within the bounds, as SB3 does for `learning_starts` steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from rlplex.agents.base import InfoSpec
from rlplex.envs import EnvSpaces, describe_observation_space
from rlplex.errors import ConfigError
from rlplex.models import unwrap_model
from rlplex.models.continuous import BoundedActor, SquashedGaussianActor
from rlplex.models.device import to_numpy


def continuous_action_dim(spaces: EnvSpaces, agent: str) -> int:
    if spaces.action_kind != "continuous":
        raise ConfigError(f"{agent} needs a Box action space (got a Discrete one)")
    if len(spaces.obs_shape) != 1 or spaces.obs_dtype != "float32":
        # Its critics live in the algorithm and read observations as flat float vectors.
        raise ConfigError(
            f"{agent} needs a 1-D float Box observation space (it has no image encoder), but the observation "
            f"space is {describe_observation_space(spaces)}; ppo, a2c and dqn take images"
        )
    return int(np.prod(spaces.action_shape))


def uniform_actions(actor: BoundedActor, n: int) -> torch.Tensor:
    """Uniform random actions in the environment's bounds, [n, A]."""
    return actor.to_env(torch.rand(n, actor.action_dim, device=actor.action_scale.device) * 2.0 - 1.0)


def actor_obs(actor: BoundedActor, observation_B_O: np.ndarray) -> torch.Tensor:
    """Observations as float32 on the actor's device (its critics read flat float vectors)."""
    return torch.as_tensor(observation_B_O, dtype=torch.float32, device=actor.action_scale.device)


class SacAgent:
    def __init__(self, spaces: EnvSpaces, hidden: Sequence[int] = (256, 256)) -> None:
        action_dim = continuous_action_dim(spaces, "SacAgent")
        self.spaces = spaces
        self.info_spec: InfoSpec = {}
        obs_dim = int(np.prod(spaces.obs_shape))
        self.model: nn.Module = SquashedGaussianActor(
            obs_dim, action_dim, spaces.action_low, spaces.action_high, hidden
        )

    @property
    def actor(self) -> SquashedGaussianActor:
        actor = unwrap_model(self.model)
        assert isinstance(actor, SquashedGaussianActor)
        return actor

    def set_random_actions(self, on: bool) -> None:
        self.actor.random_actions.fill_(float(on))

    @torch.no_grad()
    def step(self, observation_B_O: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        actor = self.actor
        if bool(actor.random_actions):
            return to_numpy(uniform_actions(actor, len(observation_B_O))), {}
        action, _ = actor.sample(actor_obs(actor, observation_B_O))
        return to_numpy(actor.to_env(action)), {}

    @torch.no_grad()
    def eval_step(self, observation_B_O: np.ndarray) -> np.ndarray:
        actor = self.actor
        return to_numpy(actor.to_env(actor.mode(actor_obs(actor, observation_B_O))))
