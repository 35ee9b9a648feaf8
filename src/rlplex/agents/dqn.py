"""The DQN agent: epsilon-greedy over a Q-network (plain, dueling, or categorical C51).

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


class DqnAgent:
    def __init__(
        self,
        spaces: EnvSpaces,
        hidden: Sequence[int] = (64, 64),
        dueling: bool = False,
        n_atoms: int = 1,
        v_min: float = -10.0,
        v_max: float = 10.0,
    ) -> None:
        if spaces.action_kind != "discrete":
            raise ConfigError(
                f"DQN needs a Discrete action space; the environment's is {describe_action_space(spaces)} "
                "(use SAC, TD3 or DDPG for continuous actions)"
            )
        if dueling and not hidden:
            raise ConfigError("field 'agent.hidden': a dueling DQN needs at least one hidden layer (got none)")
        self.spaces = spaces
        self.info_spec: InfoSpec = {}
        self.model: nn.Module = QMlp(
            int(np.prod(spaces.obs_shape)), spaces.n_actions, hidden, dueling, n_atoms, v_min, v_max
        )

    @property
    def epsilon(self) -> float:
        value = unwrap_model(self.model).epsilon
        assert isinstance(value, torch.Tensor)
        return float(value)

    def set_epsilon(self, epsilon: float) -> None:
        value = unwrap_model(self.model).epsilon
        assert isinstance(value, torch.Tensor)
        value.fill_(epsilon)

    def q_values(self, observation_B_O: torch.Tensor) -> torch.Tensor:
        inner = unwrap_model(self.model)
        assert isinstance(inner, QMlp)
        q: torch.Tensor = inner.q_values(self.model(observation_B_O))
        return q

    @torch.no_grad()
    def step(self, observation_B_O: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        q_B_A = self.q_values(torch.as_tensor(observation_B_O, dtype=torch.float32))
        greedy_B = q_B_A.argmax(dim=-1)
        n = greedy_B.shape[0]
        explore_B = torch.rand(n) < self.epsilon
        random_B = torch.randint(0, self.spaces.n_actions, (n,))
        return torch.where(explore_B, random_B, greedy_B).numpy(), {}

    @torch.no_grad()
    def eval_step(self, observation_B_O: np.ndarray) -> np.ndarray:
        q_B_A = self.q_values(torch.as_tensor(observation_B_O, dtype=torch.float32))
        return q_B_A.argmax(dim=-1).numpy()
