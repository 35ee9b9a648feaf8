"""Pieces every replay-based algorithm shares (DQN, SAC, TD3): what the replay keeps of a
sampler batch, a minibatch as tensors, and the soft target-network update."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from rlplex.replays import UniformReplayBuffer
from rlplex.samplers.batch import SampleBatch


def transitions_of(samples: SampleBatch) -> dict[str, np.ndarray]:
    """What the replay keeps of a sampler batch. Runs in AsyncRl's copier processes too."""
    return {
        "observation": samples.observation,
        "action": samples.action,
        "reward": samples.reward,
        "next_observation": samples.next_observation,
        "terminated": samples.terminated,
    }


def sample_tensors(replay: UniformReplayBuffer, batch_size: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v) for k, v in replay.sample(batch_size, rng).items()}


@torch.no_grad()
def polyak_update(target: Iterable[torch.Tensor], online: Iterable[torch.Tensor], tau: float) -> None:
    """target <- (1 - tau) target + tau online, over all tensors in one fused call."""
    torch._foreach_lerp_(list(target), list(online), tau)
