"""`SerialSampler`: every environment in the calling process, one batched policy call per step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rlplex.agents.base import state_reset_of
from rlplex.envs import EnvConfig, EnvSpaces, env_seed, make_env, probe_spaces
from rlplex.errors import RlplexError
from rlplex.samplers.batch import SampleBatch, allocate_batch
from rlplex.samplers.collector import EnvCollector
from rlplex.samplers.rng import fit_env_states

if TYPE_CHECKING:  # agents import samplers.batch; a run-time import here would be circular
    from rlplex.agents.base import Agent


class SerialSampler:
    def __init__(self, env: EnvConfig, batch_T: int, batch_B: int) -> None:
        self.env_config = env
        self.batch_T = batch_T
        self.batch_B = batch_B
        self._collector: EnvCollector | None = None
        self._agent: Agent | None = None
        self._batch: SampleBatch | None = None
        self._rank = 0

    def initialize(self, agent: Agent, seed: int, rank: int = 0) -> None:
        spaces = probe_spaces(self.env_config)
        seeds = [env_seed(seed, rank, 0, i) for i in range(self.batch_B)]
        self._collector = self._make_collector(spaces, seeds)
        self._agent, self._rank = agent, rank
        self._batch = allocate_batch(spaces, agent.info_spec, self.batch_T, self.batch_B)

    def _make_collector(self, spaces: EnvSpaces, seeds: list[int]) -> EnvCollector:
        return EnvCollector([make_env(self.env_config) for _ in seeds], spaces, seeds)

    def obtain_samples(self, itr: int) -> SampleBatch:
        if self._collector is None or self._agent is None or self._batch is None:
            raise RlplexError(f"{type(self).__name__}.obtain_samples called before initialize()")
        # inference_mode: no autograd bookkeeping at all, a few µs less per policy call.
        with torch.inference_mode():
            self._collector.collect(self._agent.step, self._batch, state_reset_of(self._agent))
        return self._batch

    def state_dict(self) -> dict[str, Any]:
        """The environments' generator states. The policy samples from this process's global
        generators, which the runner's snapshot holds itself: no process states here."""
        if self._collector is None:
            raise RlplexError(f"{type(self).__name__}.state_dict called before initialize()")
        return {"processes": [], "envs": self._collector.rng_states()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._collector is None:
            raise RlplexError(f"{type(self).__name__}.load_state_dict called before initialize()")
        self._collector.restore_rng_states(fit_env_states(state["envs"], self.batch_B, self._rank))

    def shutdown(self) -> None:
        if self._collector is not None:
            self._collector.close()
            self._collector = None
