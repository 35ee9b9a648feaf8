"""The agent protocol: what samplers, evaluators and algorithms call on an agent."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from torch import nn

from rlplex.envs import EnvSpaces

InfoSpec = dict[str, tuple[tuple[int, ...], Any]]
"""Per-sample arrays an agent returns from `step` beside the action: name -> (shape, dtype)."""


class Agent(Protocol):
    """An acting policy around one `nn.Module`.

    `model` holds everything a sampler needs (parameters and buffers): copying its
    `state_dict` is how weights reach sampler processes. `step` and `eval_step` take and
    return numpy arrays over a batch of environments and never track gradients.
    """

    model: nn.Module
    spaces: EnvSpaces
    info_spec: InfoSpec

    def step(self, observation_B_O: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Sample actions for a batch of observations; returns (action_B, agent_info)."""
        ...

    def eval_step(self, observation_B_O: np.ndarray) -> np.ndarray:
        """Deterministic actions where the agent has them (argmax, the Gaussian mean)."""
        ...

    # A recurrent agent (rlplex.agents.recurrent) also has `reset_state(done_B)`, called by the
    # samplers after every step, and `reset_eval_state()`, called by the evaluator first.


def state_reset_of(agent: Agent) -> Callable[[np.ndarray], None] | None:
    """A recurrent agent's `reset_state(done_B)` (samplers call it after every step with the
    environments whose episode just ended); None for an agent without state."""
    reset: Callable[[np.ndarray], None] | None = getattr(agent, "reset_state", None)
    return reset


AgentFactory = Callable[[EnvSpaces], Agent]
"""Builds an agent for given spaces. Must be picklable (a class or functools.partial) so that
sampler worker processes started with `spawn` can build their own copy."""
