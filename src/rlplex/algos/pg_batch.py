"""What the policy-gradient algorithms (PPO, A2C) share: GAE advantages and returns of a
[T, B] sample batch (`rl_math.gae` on the agent's values), and gradient-norm clipping for
small models."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rlplex.agents.pg import PgAgent
from rlplex.algos.rl_math import gae
from rlplex.samplers.batch import SampleBatch


def clip_grad_norm(params: Sequence[torch.Tensor], max_norm: float) -> None:
    """`torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)` for tensors on one device.

    The same arithmetic (per-tensor norms, their norm, a coefficient clamped at 1, one fused
    multiply), without the grouping by device and dtype that costs as much as the clipping
    itself for a small MLP.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))


def advantages_and_returns(
    agent: PgAgent, samples: SampleBatch, gamma: float, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    """(GAE advantages, their value targets) over [T, B], bootstrapping every step with the
    value of its `next_observation` (so through time-limit truncations, not terminations)."""
    next_value = agent.next_values(samples)
    value = samples.agent_info["value"]
    advantage = gae(samples.reward, value, next_value, samples.terminated, samples.truncated, gamma, lam)
    return advantage, advantage + value
