"""`SerialSampler`: every environment in the calling process, one batched policy call per step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlplex.agents.base import state_reset_of
from rlplex.envs import EnvConfig, env_seed, make_env, probe_spaces
from rlplex.errors import RlplexError
from rlplex.samplers.batch import SampleBatch, allocate_batch
from rlplex.samplers.collector import EnvCollector

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

    def initialize(self, agent: Agent, seed: int, rank: int = 0) -> None:
        spaces = probe_spaces(self.env_config)
        envs = [make_env(self.env_config) for _ in range(self.batch_B)]
        seeds = [env_seed(seed, rank, 0, i) for i in range(self.batch_B)]
        self._collector = EnvCollector(envs, spaces, seeds)
        self._agent = agent
        self._batch = allocate_batch(spaces, agent.info_spec, self.batch_T, self.batch_B)

    def obtain_samples(self, itr: int) -> SampleBatch:
        if self._collector is None or self._agent is None or self._batch is None:
            raise RlplexError("SerialSampler.obtain_samples called before initialize()")
        # inference_mode: no autograd bookkeeping at all, a few µs less per policy call.
        with torch.inference_mode():
            self._collector.collect(self._agent.step, self._batch, state_reset_of(self._agent))
        return self._batch

    def shutdown(self) -> None:
        if self._collector is not None:
            self._collector.close()
            self._collector = None
