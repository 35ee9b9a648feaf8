"""ParallelSampler: real spawned workers, real shared memory, real CartPole environments."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rlplex.agents import CategoricalPgAgent, RandomAgent
from rlplex.algos import PPO, PPOConfig
from rlplex.envs import EnvConfig, env_seed, make_env, probe_spaces
from rlplex.errors import WorkerDiedError
from rlplex.io.snapshot import list_snapshots, read_snapshot
from rlplex.models import QMlp
from rlplex.runners import MinibatchRl
from rlplex.runners.config import TrainConfig, build_runner
from rlplex.samplers import ParallelSampler
from rlplex.samplers.batch import SampleBatch, allocate_batch
from rlplex.samplers.parallel import split_envs
from rlplex.samplers.shared import SharedBatch
from rlplex.samplers.weights import SharedWeights

torch.set_num_threads(1)
CARTPOLE = EnvConfig(id="CartPole-v1")


def _segments(sampler: ParallelSampler) -> list[str]:
    assert sampler._shared is not None and sampler._weights is not None
    return [name for _, name, _, _ in sampler._shared.handle.arrays] + [sampler._weights.handle.segment]


def _assert_cleaned_up(pids: list[int], segments: list[str]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped, not a zombie and not an orphan
    leaked = [name for name in segments if os.path.exists(f"/dev/shm/{name}")]
    assert leaked == []
    assert all(name.startswith(f"rlplex-shm-{os.getpid()}-") for name in segments)  # found by owner


@dataclass
class Started:
    sampler: ParallelSampler
    agent: CategoricalPgAgent
    first: SampleBatch  # copies of the first two batches, taken before any test changes the agent
    second: SampleBatch


@pytest.fixture(scope="module")
def started() -> Iterator[Started]:
    """One sampler for the read-only tests (worker start-up is most of a test's time)."""
    agent = CategoricalPgAgent(probe_spaces(CARTPOLE))
    # 5 envs over 2 workers: an uneven split (3 + 2).
    sampler = ParallelSampler(CARTPOLE, batch_T=64, batch_B=5, n_workers=2, agent_factory=CategoricalPgAgent)
    try:
        sampler.initialize(agent, seed=3, rank=1)
        first = sampler.obtain_samples(0).copy()
        second = sampler.obtain_samples(1).copy()
        yield Started(sampler, agent, first, second)
    finally:
        sampler.shutdown()


def test_split_envs_covers_all_envs_unevenly() -> None:
    assert split_envs(5, 2) == [(0, 3), (3, 5)]
    assert split_envs(16, 3) == [(0, 6), (6, 11), (11, 16)]


def test_batch_is_consistent_across_workers_and_batches(started: Started) -> None:
    first, second = started.first, started.second
    layout = allocate_batch(probe_spaces(CARTPOLE), started.agent.info_spec, 64, 5)
    for (name, got), (_, want) in zip(started.sampler.obtain_samples(2).arrays(), layout.arrays(), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype, name
    done = first.terminated | first.truncated
    assert done[:, 3:].any() and done[:, :3].any()  # episodes ended in both workers' envs
    same = np.all(np.isclose(first.observation[1:], first.next_observation[:-1]), axis=-1)
    assert np.all(same[~done[:-1]]) and not np.any(same[done[:-1]])
    assert np.allclose(second.observation[0][~done[-1]], first.next_observation[-1][~done[-1]])
    returns, lengths = first.episode_stats()
    assert len(returns) == int(done.sum()) and np.all(returns == lengths) and np.all(lengths > 0)
    assert np.all(first.agent_info["log_prob"] <= 0) and np.all(np.isfinite(first.agent_info["value"]))
    assert set(np.unique(first.action)) == {0, 1}


def test_env_seeds_are_disjoint_and_used_by_the_workers(started: Started) -> None:
    sampler = started.sampler
    assert sampler.env_seeds == [tuple(env_seed(3, 1, w, j) for j in range(n)) for w, n in ((0, 3), (1, 2))]
    flat = [s for seeds in sampler.env_seeds for s in seeds]
    assert len(set(flat)) == 5
    for b, seed in enumerate(flat):
        env = make_env(CARTPOLE)
        expected, _ = env.reset(seed=seed)
        env.close()
        assert np.allclose(started.first.observation[0, b], expected), f"env {b} was not reset with seed {seed}"


def test_new_weights_reach_the_workers_at_the_next_batch(started: Started) -> None:
    sampler, agent = started.sampler, started.agent
    assert np.any(sampler.obtain_samples(3).action == 1)
    last_pi, last_v = agent.model.pi[-1], agent.model.v[-1]
    with torch.no_grad():  # a policy that always picks action 0, and a constant value
        last_pi.weight.zero_()
        last_pi.bias.copy_(torch.tensor([30.0, -30.0]))
        last_v.weight.zero_()
        last_v.bias.fill_(3.5)
    after = sampler.obtain_samples(4)
    assert np.all(after.action == 0)
    assert np.allclose(after.agent_info["log_prob"], 0.0, atol=1e-6)
    assert np.allclose(after.agent_info["value"], 3.5)


def test_shared_weights_carry_buffers_and_bump_the_version_only_on_change() -> None:
    model = QMlp(4, 2)
    owner = SharedWeights.create(model.state_dict())
    reader = SharedWeights.attach(owner.handle)
    try:
        assert owner.version == 1 and not owner.write(model.state_dict()) and owner.version == 1
        model.epsilon.fill_(0.25)
        assert owner.write(model.state_dict()) and reader.version == 2
        copy = QMlp(4, 2)
        copy.load_state_dict(reader.tensors)
        assert float(copy.epsilon) == 0.25 and torch.equal(copy.q[0].weight, model.q[0].weight)
    finally:
        reader.close()
        owner.close()
    assert not os.path.exists(f"/dev/shm/{owner.handle.segment}")


def test_sigkilled_worker_is_named_and_everything_is_cleaned_up() -> None:
    agent = RandomAgent(probe_spaces(CARTPOLE))
    # No agent_factory: the workers receive a pickled copy of the master's agent.
    sampler = ParallelSampler(CARTPOLE, batch_T=32, batch_B=4, n_workers=2)
    try:
        sampler.initialize(agent, seed=0)
        sampler.obtain_samples(0)
        pids = [p.pid for p in sampler.processes if p.pid is not None]
        segments = _segments(sampler)
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            sampler.obtain_samples(1)
        assert time.monotonic() - t0 < 10.0  # fails fast: a wait on a dead worker would hang
        message = str(info.value)
        assert "rank 0 sampler worker 1" in message and f"pid {pids[1]}" in message and "exit code -9" in message
        _assert_cleaned_up(pids, segments)
    finally:
        sampler.shutdown()


def test_worker_that_fails_at_start_up_is_reported_without_leaks(monkeypatch: pytest.MonkeyPatch) -> None:
    created: list[str] = []  # record the segments the sampler makes (other processes share /dev/shm)
    create_batch, create_weights = SharedBatch.create.__func__, SharedWeights.create.__func__

    def record_batch(cls: type[SharedBatch], *args: Any) -> SharedBatch:
        shared = create_batch(cls, *args)
        created.extend(name for _, name, _, _ in shared.handle.arrays)
        return shared

    def record_weights(cls: type[SharedWeights], *args: Any) -> SharedWeights:
        shared = create_weights(cls, *args)
        created.append(shared.handle.segment)
        return shared

    monkeypatch.setattr(SharedBatch, "create", classmethod(record_batch))
    monkeypatch.setattr(SharedWeights, "create", classmethod(record_weights))
    pendulum = EnvConfig(id="Pendulum-v1")
    agent = RandomAgent(probe_spaces(pendulum))
    # CategoricalPgAgent refuses a Box action space: the worker raises while building its agent.
    sampler = ParallelSampler(pendulum, batch_T=8, batch_B=1, n_workers=1, agent_factory=CategoricalPgAgent)
    with pytest.raises(WorkerDiedError, match="exit code 1"):
        sampler.initialize(agent, seed=0)
    assert sampler.processes == [] and len(created) > 1
    _assert_cleaned_up([], created)


class _KillWorkerAfter(PPO):
    """PPO that SIGKILLs sampler worker 1 after optimising iteration `kill_itr` (fault injection)."""

    def __init__(self, sampler: ParallelSampler, kill_itr: int) -> None:
        super().__init__(PPOConfig(n_epochs=1, minibatch_size=64))
        self.sampler, self.kill_itr, self.killed_pid = sampler, kill_itr, 0

    def optimize_agent(self, itr: int, samples: Any) -> dict[str, float]:
        info = super().optimize_agent(itr, samples)
        if itr == self.kill_itr:
            self.killed_pid = self.sampler.processes[1].pid or 0
            os.kill(self.killed_pid, signal.SIGKILL)
        return info


def test_runner_stops_cleanly_when_a_worker_dies_and_keeps_its_last_snapshot(tmp_path: Path) -> None:
    agent = CategoricalPgAgent(probe_spaces(CARTPOLE))
    sampler = ParallelSampler(CARTPOLE, batch_T=32, batch_B=4, n_workers=2, agent_factory=CategoricalPgAgent)
    algo = _KillWorkerAfter(sampler, kill_itr=1)
    runner = MinibatchRl(
        algo, agent, sampler, n_steps=128 * 6, log_interval_steps=128, log_dir=tmp_path, snapshot_mode="all",
        show_progress=False,
    )  # fmt: skip
    with pytest.raises(WorkerDiedError, match="worker 1"):
        runner.train()
    assert sampler.processes == [] and sampler._shared is None
    with pytest.raises(ProcessLookupError):
        os.kill(algo.killed_pid, 0)
    snapshots = list_snapshots(tmp_path / "snapshots")
    assert [itr for itr, _ in snapshots] == [0, 1]
    assert read_snapshot(snapshots[-1][1])["itr"] == 1


@pytest.mark.slow
def test_minibatch_ppo_with_parallel_sampler_from_config(tmp_path: Path) -> None:
    config = TrainConfig.model_validate(
        {
            "env": {"id": "CartPole-v1"},
            "sampler": {"kind": "parallel", "batch_T": 32, "batch_B": 4, "n_workers": 2},
            "algo": {"name": "ppo", "n_epochs": 1, "minibatch_size": 64},
            "runner": {"kind": "minibatch", "n_steps": 256, "log_interval_steps": 128},
        }
    )
    runner = build_runner(config, tmp_path, show_progress=False)
    assert isinstance(runner.sampler, ParallelSampler)
    assert isinstance(runner.sampler.agent_factory, partial)
    result = runner.train()
    assert result.env_steps == 256 and len(result.history) == 2
    assert "charts/online_return_mean" in result.history[-1] and "losses/policy" in result.history[-1]
    assert runner.sampler.processes == []


def _uniform_policy_batch(seed: int) -> np.ndarray:
    torch.manual_seed(0)
    agent = CategoricalPgAgent(probe_spaces(CARTPOLE))
    with torch.no_grad():  # p(action) = 0.5 whatever the observation: actions show the workers' random streams
        agent.model.pi[-1].weight.zero_()
        agent.model.pi[-1].bias.zero_()
    sampler = ParallelSampler(CARTPOLE, batch_T=64, batch_B=4, n_workers=2, agent_factory=CategoricalPgAgent)
    try:
        sampler.initialize(agent, seed=seed)
        return sampler.obtain_samples(0).action.copy()
    finally:
        sampler.shutdown()


@pytest.mark.slow
def test_workers_draw_from_distinct_reproducible_random_streams() -> None:
    first, again = _uniform_policy_batch(seed=5), _uniform_policy_batch(seed=5)
    assert np.array_equal(first, again)
    assert not np.array_equal(first[:, 0:2], first[:, 2:4])  # worker 0's draws are not worker 1's
