"""The sampler protocol, and the deterministic evaluator used by the *Eval runners."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from rlplex.envs import EnvConfig, env_seed, make_env, probe_spaces
from rlplex.samplers.batch import SampleBatch
from rlplex.samplers.collector import run_episodes

if TYPE_CHECKING:  # agents import samplers.batch; a run-time import here would be circular
    from rlplex.agents.base import Agent


class Sampler(Protocol):
    """Collects [batch_T, batch_B] batches of experience with the current agent.

    `initialize` builds environments (and workers, for parallel samplers). `obtain_samples`
    first brings any remote copy of the agent up to date, then returns a batch that stays
    valid until the next call. `state_dict`/`load_state_dict` carry the random streams
    across a resume. `shutdown` releases every process and shared buffer.
    """

    batch_T: int
    batch_B: int

    def initialize(self, agent: Agent, seed: int, rank: int = 0) -> None: ...

    def obtain_samples(self, itr: int) -> SampleBatch: ...

    def state_dict(self) -> dict[str, Any]:
        """Generator states that a snapshot needs to continue sampling's random streams:
        `processes` (one JSON state per worker process; empty when the policy runs in the
        caller's process) and `envs` (one per environment, in batch order)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the streams of `state` (after `initialize`, before the next batch)."""
        ...

    def shutdown(self) -> None: ...


class Evaluator:
    """Runs `n_episodes` deterministic episodes in this process, with seeds apart from training."""

    # Evaluation seeds live in their own rank range so they never equal a training env's seed.
    EVAL_RANK_OFFSET = 1_000_000

    def __init__(self, env: EnvConfig, n_episodes: int = 10, seed: int = 0, rank: int = 0) -> None:
        self.env_config = env
        self.n_episodes = n_episodes
        self.spaces = probe_spaces(env)
        self._envs = [make_env(env, mode="eval") for _ in range(n_episodes)]
        self._seed = seed
        self._rank = rank
        self.calls = 0  # evaluations so far: each draws its own seeds (a snapshot keeps the count)

    def evaluate(self, agent: Agent) -> tuple[np.ndarray, np.ndarray]:
        self.calls += 1
        seeds = [
            env_seed(self._seed, self.EVAL_RANK_OFFSET + self._rank, self.calls, i) for i in range(self.n_episodes)
        ]
        reset_eval_state = getattr(agent, "reset_eval_state", None)
        if reset_eval_state is not None:  # a recurrent agent: every evaluation starts from a zero state
            reset_eval_state()
        return run_episodes(self._envs, self.spaces, agent.eval_step, seeds)

    def close(self) -> None:
        for env in self._envs:
            env.close()
