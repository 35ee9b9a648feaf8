"""Pieces every replay-based algorithm shares (DQN, SAC, TD3): the replay and the loop around
the updates (`ReplayAlgo`), what the replay keeps of a sampler batch, a minibatch as tensors,
and the soft target-network update."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, ClassVar

import numpy as np
import torch

from rlplex.errors import RlplexError
from rlplex.processes import CONTEXT
from rlplex.replays import PrioritizedReplayBuffer, UniformReplayBuffer
from rlplex.samplers.batch import SampleBatch

logger = logging.getLogger(__name__)


def transitions_of(samples: SampleBatch) -> dict[str, np.ndarray]:
    """What the replay keeps of a sampler batch. Runs in AsyncRl's copier processes too."""
    return {
        "observation": samples.observation,
        "action": samples.action,
        "reward": samples.reward,
        "next_observation": samples.next_observation,
        "terminated": samples.terminated,
        "done": samples.terminated | samples.truncated,  # where n-step returns stop
    }


def sample_tensors(
    replay: UniformReplayBuffer, batch_size: int, rng: np.random.Generator, device: torch.device
) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v, device=device) for k, v in replay.sample(batch_size, rng).items()}


def update_generator(seed: int, device: torch.device, cpu_generator: torch.Generator) -> torch.Generator:
    """The generator of an update's noise: on the model's device, since a draw must come from a
    generator where the tensor is made. On the CPU it is `cpu_generator` itself (which also
    drew the critics' initial weights), so a CPU run's streams are what they always were."""
    if device.type == "cpu":
        return cpu_generator
    return torch.Generator(device=device).manual_seed(seed)


def load_generator_state(generator: torch.Generator, state: torch.Tensor, what: str) -> None:
    """Restore a generator saved by `state_dict`; a snapshot taken on another kind of device
    (CPU against CUDA) holds another generator's state, so its noise starts afresh instead."""
    try:
        generator.set_state(state)
    except RuntimeError:
        logger.warning("%s: the snapshot's generator is of another device; its noise stream starts afresh", what)


@torch.no_grad()
def polyak_update(target: Iterable[torch.Tensor], online: Iterable[torch.Tensor], tau: float) -> None:
    """target <- (1 - tau) target + tau online, over all tensors in one fused call."""
    torch._foreach_lerp_(list(target), list(online), tau)


class ReplayAlgo:
    """The loop every replay-based algorithm runs around its own update: store the batch, set
    the agent's exploration for the next one (`_explore`), and once the replay holds
    `learning_starts` transitions run `updates_per_itr` updates (`_updates`, their mean metrics).
    The config needs `batch_size`, `learning_starts`, `updates_per_itr` and `buffer_size`."""

    name: ClassVar[str]
    config: Any
    agent: Any
    replay: UniformReplayBuffer | None
    device: torch.device = torch.device("cpu")  # the agent's model's: where batches go (see `initialize`)

    @property
    def batch_size(self) -> int:
        return int(self.config.batch_size)

    @property
    def learning_starts(self) -> int:
        return int(self.config.learning_starts)

    def _make_replay(self, agent: Any, shared_replay: bool, prioritized: bool = False) -> None:
        """`shared_replay` puts the replay in shared memory (AsyncRl's copiers write into it),
        priorities included."""
        lock = CONTEXT.Lock() if shared_replay else None
        cls = PrioritizedReplayBuffer if prioritized else UniformReplayBuffer
        self.replay = cls.create(agent.spaces, self.config.buffer_size, shared=shared_replay, lock=lock)

    def shutdown(self) -> None:
        if self.replay is not None:
            self.replay.close()

    def copier_factory(self, batch_B: int) -> Callable[[], Any]:
        """What builds this algorithm in AsyncRl's copier processes (picklable; called once the
        algorithm is initialized, before a resumed run loads its state): there only
        `sampler_to_buffer` runs, so the same config is all a copier needs unless cutting a
        batch keeps state between batches (R2D1)."""
        algo_class: Any = type(self)  # each algorithm's __init__ takes its config
        return partial(algo_class, self.config)

    def sampler_to_buffer(self, samples: SampleBatch) -> dict[str, np.ndarray]:
        """What the replay keeps of a sampler batch. Runs in AsyncRl's copier processes too."""
        return transitions_of(samples)

    def optimize_agent(self, itr: int, samples: SampleBatch | None, n_updates: int | None = None) -> dict[str, float]:
        """Store `samples` (None: someone else filled the replay), then do `n_updates` updates
        (default `updates_per_itr`) once the replay holds `learning_starts` transitions."""
        if self.agent is None or self.replay is None:
            raise RlplexError(f"{self.name}.optimize_agent called before initialize()")
        if samples is not None:
            self.replay.append_samples(self.sampler_to_buffer(samples))
        metrics = {**self._explore(itr), "charts/replay_size": float(self.replay.size)}
        n = self.config.updates_per_itr if n_updates is None else n_updates
        if self.replay.size < max(1, self.learning_starts) or n <= 0:
            return metrics
        metrics.update(self._updates(n))
        return metrics

    def _explore(self, itr: int) -> dict[str, float]:
        """Set the agent's exploration for the next batch; return what to log of it."""
        raise NotImplementedError

    def _updates(self, n: int) -> dict[str, float]:
        """Run `n` updates; return their mean metrics."""
        raise NotImplementedError
