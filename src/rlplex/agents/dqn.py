"""The DQN agent: epsilon-greedy over a Q-network (plain, dueling, or categorical C51), behind
the observation encoder its space calls for (`rlplex.models.encoders`: the Nature CNN for
images).

Epsilon is read from the model's `epsilon` buffer at every step, not kept on the agent, so
that the algorithm's schedule reaches sampler processes with the weights (one state_dict
copy) and is saved and restored with them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from rlplex.agents.base import InfoSpec
from rlplex.envs import EnvSpaces, describe_action_space
from rlplex.errors import ConfigError
from rlplex.models import QMlp, unwrap_model
from rlplex.models.device import model_device, to_numpy
from rlplex.models.encoders import EncoderKind, as_obs_tensor, default_hidden, make_encoder


class EpsilonGreedy:
    """Epsilon lives in the model as a buffer, so the samplers' copies (weights shared by
    state_dict) act with the schedule's current value; DqnAgent and R2d1Agent share it."""

    model: nn.Module
    spaces: EnvSpaces

    @property
    def epsilon(self) -> float:
        value = unwrap_model(self.model).epsilon
        assert isinstance(value, torch.Tensor)
        return float(value)

    def set_epsilon(self, epsilon: float) -> None:
        value = unwrap_model(self.model).epsilon
        assert isinstance(value, torch.Tensor)
        value.fill_(epsilon)

    def explore(self, greedy_B: torch.Tensor) -> torch.Tensor:
        """Each greedy action replaced, with probability epsilon, by a uniform random one."""
        n, device = greedy_B.shape[0], greedy_B.device
        explore_B = torch.rand(n, device=device) < self.epsilon
        random_B = torch.randint(0, self.spaces.n_actions, (n,), device=device)
        return torch.where(explore_B, random_B, greedy_B)


class DqnAgent(EpsilonGreedy):
    def __init__(
        self,
        spaces: EnvSpaces,
        hidden: Sequence[int] | None = None,
        dueling: bool = False,
        n_atoms: int = 1,
        v_min: float = -10.0,
        v_max: float = 10.0,
        encoder: EncoderKind = "auto",
    ) -> None:
        if spaces.action_kind != "discrete":
            raise ConfigError(
                f"DQN needs a Discrete action space; the environment's is {describe_action_space(spaces)} "
                "(use SAC, TD3 or DDPG for continuous actions)"
            )
        features, in_dim = make_encoder(spaces, encoder, "DQN's DqnAgent")
        hidden = default_hidden(features) if hidden is None else tuple(hidden)
        if dueling and not hidden and features is None:
            raise ConfigError("field 'agent.hidden': a dueling DQN needs at least one hidden layer (got none)")
        self.spaces = spaces
        self.info_spec: InfoSpec = {}
        self.model: nn.Module = QMlp(in_dim, spaces.n_actions, hidden, dueling, n_atoms, v_min, v_max, features)

    def q_values(self, observation_B_O: torch.Tensor) -> torch.Tensor:
        inner = unwrap_model(self.model)
        assert isinstance(inner, QMlp)
        q: torch.Tensor = inner.q_values(self.model(observation_B_O))
        return q

    @torch.no_grad()
    def step(self, observation_B_O: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        q_B_A = self.q_values(as_obs_tensor(observation_B_O, model_device(self.model)))
        return to_numpy(self.explore(q_B_A.argmax(dim=-1))), {}

    @torch.no_grad()
    def eval_step(self, observation_B_O: np.ndarray) -> np.ndarray:
        q_B_A = self.q_values(as_obs_tensor(observation_B_O, model_device(self.model)))
        return to_numpy(q_B_A.argmax(dim=-1))
