"""The algorithm protocol that runners drive."""

from __future__ import annotations

from typing import Any, Protocol

from rlplex.agents.base import Agent
from rlplex.samplers.batch import SampleBatch


class Algo(Protocol):
    """Turns sample batches into parameter updates of `agent.model`.

    `initialize` is called once the agent exists (and, under SyncRl, after `agent.model` is
    wrapped for distributed data parallel), with the total number of iterations so that
    schedules can be set. `optimize_agent` returns namespaced metrics (`losses/...`).
    `state_dict` holds everything needed to resume exactly (optimizer, schedule counters).
    """

    def initialize(self, agent: Agent, n_itr: int, world_size: int = 1) -> None: ...

    def optimize_agent(self, itr: int, samples: SampleBatch | None) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
