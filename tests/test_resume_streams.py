"""Resume continues the run's random streams in every runner (issue 15, hole 4).

What a resumed run can share with the uninterrupted one, given that gymnasium environments
have no portable state (a resumed run starts new episodes):
- every generator whose use does not depend on the data continues where it was: this
  process's (action sampling, PPO's minibatch order), each sampler worker's, each rank's.
  Both runs then make the same number of draws, so after the last iteration their states
  are equal (`streams_digest`). Restarting from the seeds, or from rank 0's state on every
  rank, would end elsewhere.
- each environment's generator continues: the resumed run's first episode of environment i
  starts where the uninterrupted run's next episode of environment i started, not where the
  run's first episode did (a restart from the seed).
Parameters and optimizer state right after resume equal the snapshot's (test_minibatch_runner);
after that the two runs see different episodes, so their parameters part.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rlplex.agents import CategoricalPgAgent, DqnAgent
from rlplex.algos import DQN, PPO, DQNConfig, PPOConfig
from rlplex.config import validate_config
from rlplex.envs import EnvConfig, probe_spaces
from rlplex.io.snapshot import list_snapshots, read_snapshot
from rlplex.runners import MinibatchRl, MinibatchRlEval
from rlplex.runners.async_ import AsyncRl
from rlplex.runners.config import TrainConfig, build_runner
from rlplex.samplers import Evaluator, ParallelSampler, SampleBatch, SerialSampler

CARTPOLE = EnvConfig(id="CartPole-v1")


class Recording:
    """Keeps a copy of every batch a sampler returns."""

    batches: list[SampleBatch]

    def obtain_samples(self, itr: int) -> SampleBatch:
        batch: SampleBatch = super().obtain_samples(itr)  # type: ignore[misc]
        self.batches.append(batch.copy())
        return batch


class RecordingSerial(Recording, SerialSampler):
    pass


class RecordingParallel(Recording, ParallelSampler):
    pass


def minibatch_run(log_dir: Path, parallel: bool) -> tuple[MinibatchRl, Recording]:
    sampler: Any
    if parallel:
        sampler = RecordingParallel(CARTPOLE, 32, 4, n_workers=2, agent_factory=CategoricalPgAgent)
    else:
        sampler = RecordingSerial(CARTPOLE, 32, 4)
    sampler.batches = []
    runner = MinibatchRl(
        PPO(PPOConfig(n_epochs=2, minibatch_size=64)),
        CategoricalPgAgent(probe_spaces(CARTPOLE)),
        sampler,
        n_steps=4 * 128,
        log_interval_steps=128,
        log_dir=log_dir,
        snapshot_mode="all",
        show_progress=False,
    )
    return runner, sampler


def next_episode_starts(batches: list[SampleBatch]) -> dict[int, np.ndarray]:
    """Per environment, the first observation of the first episode that starts in `batches`."""
    obs = np.concatenate([b.observation for b in batches])
    ended = np.concatenate([b.completed_length for b in batches]) > 0
    starts = {}
    for i in range(obs.shape[1]):
        steps = np.flatnonzero(ended[:-1, i])
        if len(steps):
            starts[i] = obs[steps[0] + 1, i]
    return starts


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_minibatch_resume_continues_every_random_stream(tmp_path: Path, parallel: bool) -> None:
    whole, whole_sampler = minibatch_run(tmp_path / "whole", parallel)
    whole.train()
    snapshot = list_snapshots(tmp_path / "whole" / "snapshots")[1][1]  # after iteration 1 of 0..3
    saved = read_snapshot(snapshot)
    assert len(saved["sampler"]["envs"]) == 4 and all(s is not None for s in saved["sampler"]["envs"])
    assert len(saved["sampler"]["processes"]) == (2 if parallel else 0)

    resumed, resumed_sampler = minibatch_run(tmp_path / "resumed", parallel)
    resumed.resume_from(snapshot)
    resumed.train()

    assert whole.final_streams_digest is not None
    assert resumed.final_streams_digest == whole.final_streams_digest
    # The resumed run's new episodes continue each environment's generator ...
    first_obs = resumed_sampler.batches[0].observation[0]
    expected = next_episode_starts(whole_sampler.batches[2:])
    assert len(expected) >= 2, "too few episodes ended after the snapshot to compare"
    for i, start in expected.items():
        np.testing.assert_array_equal(first_obs[i], start, err_msg=f"env {i}")
    # ... rather than restarting it from the run's seed.
    assert not np.any(np.all(first_obs == whole_sampler.batches[0].observation[0], axis=-1))


def test_a_restart_from_the_seeds_would_be_caught(tmp_path: Path) -> None:
    """The check above can fail: without the sampler's streams the environments start over."""
    whole, whole_sampler = minibatch_run(tmp_path / "whole", parallel=False)
    whole.train()
    snapshot = list_snapshots(tmp_path / "whole" / "snapshots")[1][1]
    resumed, resumed_sampler = minibatch_run(tmp_path / "resumed", parallel=False)
    resumed.resume_from(snapshot)
    assert resumed._resume_state is not None
    del resumed._resume_state["sampler"]  # as a snapshot of before this change
    resumed.train()
    np.testing.assert_array_equal(resumed_sampler.batches[0].observation[0], whole_sampler.batches[0].observation[0])


def sync_config(n_steps: int) -> TrainConfig:
    data = {
        "env": {"id": "CartPole-v1"},
        "sampler": {"kind": "serial", "batch_T": 32, "batch_B": 2},
        "algo": {"name": "ppo", "n_epochs": 1, "minibatch_size": 64},
        "runner": {"kind": "sync", "world_size": 2, "n_steps": n_steps, "log_interval_steps": 64,
                   "snapshot_mode": "all"},
    }  # fmt: skip
    return validate_config(TrainConfig, data)


@pytest.mark.slow
def test_sync_resume_continues_each_ranks_own_streams(tmp_path: Path) -> None:
    whole = build_runner(sync_config(4 * 128), tmp_path / "whole", show_progress=False)
    whole.train()
    snapshot = list_snapshots(tmp_path / "whole" / "snapshots")[1][1]
    ranks = read_snapshot(snapshot)["ranks"]
    assert len(ranks) == 2 and ranks[0]["process"] != ranks[1]["process"]

    resumed = build_runner(sync_config(4 * 128), tmp_path / "resumed", show_progress=False)
    resumed.resume_from(snapshot)
    resumed.train()
    whole_digests = [o.digests["streams"] for o in whole.rank_outcomes]
    assert whole_digests[0] != whole_digests[1]
    assert [o.digests["streams"] for o in resumed.rank_outcomes] == whole_digests


def async_run(log_dir: Path, n_workers: int | None) -> AsyncRl:
    config = DQNConfig(batch_size=16, learning_starts=0, buffer_size=4096)
    return AsyncRl(
        DQN(config, seed=0),
        partial(DqnAgent, hidden=(16,)),
        CARTPOLE,
        batch_T=32,
        batch_B=2,
        n_steps=1024,
        replay_ratio=1.0,
        log_interval_steps=256,
        log_dir=log_dir,
        snapshot_mode="all",
        show_progress=False,
        n_workers=n_workers,
    )


@pytest.mark.slow
@pytest.mark.parametrize("n_workers", [None, 2], ids=["one-process", "parallel"])
def test_async_resume_continues_the_samplers_streams(tmp_path: Path, n_workers: int | None) -> None:
    whole = async_run(tmp_path / "whole", n_workers)
    whole.train()
    found = list_snapshots(tmp_path / "whole" / "snapshots")
    snapshot = next(path for itr, path in found if 0 < itr < 15)
    saved = read_snapshot(snapshot)
    # The states of the sampler's process (and workers), with the env steps they go with.
    assert len(saved["sampler"]["processes"]) == 1 + (n_workers or 0)
    assert 0 < int(saved["env_steps"]) < 1024

    resumed = async_run(tmp_path / "resumed", n_workers)
    resumed.resume_from(snapshot)
    result = resumed.train()
    assert result.env_steps == 1024
    assert whole.final_streams_digest is not None
    assert resumed.final_streams_digest == whole.final_streams_digest


def test_an_eval_runner_resumes_its_evaluation_count(tmp_path: Path) -> None:
    """Evaluation seeds come from the count of evaluations: a resume goes on counting, so it
    evaluates on new episodes rather than on those of the first evaluations again."""

    def make(log_dir: Path) -> MinibatchRlEval:
        return MinibatchRlEval(
            PPO(PPOConfig(n_epochs=1, minibatch_size=64)),
            CategoricalPgAgent(probe_spaces(CARTPOLE)),
            SerialSampler(CARTPOLE, 32, 4),
            n_steps=3 * 128,
            log_interval_steps=128,
            log_dir=log_dir,
            snapshot_mode="all",
            show_progress=False,
            evaluator=Evaluator(CARTPOLE, n_episodes=2),
        )

    whole = make(tmp_path / "whole")
    whole.train()
    assert whole.evaluator.calls == 3
    snapshot = list_snapshots(tmp_path / "whole" / "snapshots")[1][1]
    assert read_snapshot(snapshot)["evaluator_calls"] == 2
    resumed = make(tmp_path / "resumed")
    resumed.resume_from(snapshot)
    resumed.train()
    assert resumed.evaluator.calls == 3
