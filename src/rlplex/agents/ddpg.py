"""The DDPG/TD3 agent: a deterministic tanh policy with Gaussian exploration noise.

The noise std lives in the actor's `exploration_noise` buffer and is in normalised units
(the action scaled to [-1, 1]), so 0.1 means a tenth of the half-range on every dimension.
Before learning starts the agent acts uniformly at random (the `random_actions` buffer).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from rlplex.agents.base import InfoSpec
from rlplex.agents.sac import actor_obs, continuous_action_dim, uniform_actions
from rlplex.envs import EnvSpaces
from rlplex.models import unwrap_model
from rlplex.models.continuous import DeterministicActor
from rlplex.models.device import to_numpy


class DdpgAgent:
    def __init__(self, spaces: EnvSpaces, hidden: Sequence[int] = (256, 256), exploration_noise: float = 0.1) -> None:
        action_dim = continuous_action_dim(spaces, "DdpgAgent")
        self.spaces = spaces
        self.info_spec: InfoSpec = {}
        obs_dim = int(np.prod(spaces.obs_shape))
        self.model: nn.Module = DeterministicActor(
            obs_dim, action_dim, spaces.action_low, spaces.action_high, hidden, exploration_noise
        )

    @property
    def actor(self) -> DeterministicActor:
        actor = unwrap_model(self.model)
        assert isinstance(actor, DeterministicActor)
        return actor

    def set_random_actions(self, on: bool) -> None:
        self.actor.random_actions.fill_(float(on))

    @torch.no_grad()
    def step(self, observation_B_O: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        actor = self.actor
        if bool(actor.random_actions):
            return to_numpy(uniform_actions(actor, len(observation_B_O))), {}
        action = actor(actor_obs(actor, observation_B_O))
        action = (action + torch.randn_like(action) * actor.exploration_noise).clamp_(-1.0, 1.0)
        return to_numpy(actor.to_env(action)), {}

    @torch.no_grad()
    def eval_step(self, observation_B_O: np.ndarray) -> np.ndarray:
        actor = self.actor
        return to_numpy(actor.to_env(actor(actor_obs(actor, observation_B_O))))
