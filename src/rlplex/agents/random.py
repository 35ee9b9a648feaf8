"""`RandomAgent`: uniform random actions, for benchmarks and as a baseline.

Its model has no parameters, so samplers that ship weights to workers ship nothing; it
records no agent info.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from rlplex.agents.base import InfoSpec
from rlplex.envs import EnvSpaces


class RandomAgent:
    def __init__(self, spaces: EnvSpaces, seed: int | None = None) -> None:
        self.spaces = spaces
        self.model: nn.Module = nn.Module()
        self.info_spec: InfoSpec = {}
        self._rng = np.random.default_rng(seed)
        if spaces.action_kind == "continuous":
            self._low = np.asarray(spaces.action_low, dtype=np.float32).reshape(spaces.action_shape)
            self._high = np.asarray(spaces.action_high, dtype=np.float32).reshape(spaces.action_shape)

    def step(self, observation_B_O: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        return self.eval_step(observation_B_O), {}

    def eval_step(self, observation_B_O: np.ndarray) -> np.ndarray:
        n = len(observation_B_O)
        if self.spaces.action_kind == "discrete":
            return self._rng.integers(self.spaces.n_actions, size=n)
        shape = (n, *self.spaces.action_shape)
        return self._rng.uniform(self._low, self._high, size=shape).astype(np.float32)
