from __future__ import annotations

import numpy as np
import pytest

from rlplex.agents import CategoricalPgAgent, GaussianPgAgent
from rlplex.envs import EnvConfig, env_seed, make_env, probe_spaces
from rlplex.errors import EnvironmentSpecError
from rlplex.samplers import Evaluator, SerialSampler


def test_unknown_env_id_is_named_with_suggestion() -> None:
    with pytest.raises(EnvironmentSpecError) as info:
        make_env(EnvConfig(id="CartPol-v1"))
    assert "env.id" in str(info.value) and "CartPol-v1" in str(info.value) and "CartPole-v1" in str(info.value)


def test_env_seeds_are_disjoint_across_rank_worker_env() -> None:
    seeds = {env_seed(0, r, w, e) for r in range(4) for w in range(4) for e in range(16)}
    assert len(seeds) == 4 * 4 * 16
    assert env_seed(0, 0, 1, 0) != env_seed(0, 0, 0, 1)  # rlpyt's seed + worker + env collided here


def test_serial_batch_is_consistent(cartpole: EnvConfig) -> None:
    agent = CategoricalPgAgent(probe_spaces(cartpole))
    sampler = SerialSampler(cartpole, batch_T=64, batch_B=4)
    sampler.initialize(agent, seed=3)
    try:
        first = sampler.obtain_samples(0).copy()
        second = sampler.obtain_samples(1).copy()
    finally:
        sampler.shutdown()
    done = first.terminated | first.truncated
    # Within a batch, the next observation is the following observation unless the episode ended.
    same = np.all(np.isclose(first.observation[1:], first.next_observation[:-1]), axis=-1)
    assert np.all(same[~done[:-1]]) and not np.any(same[done[:-1]])
    # Episodes carry over from one batch to the next.
    assert np.allclose(second.observation[0][~done[-1]], first.next_observation[-1][~done[-1]])
    returns, lengths = first.episode_stats()
    assert len(returns) == int(done.sum()) and np.all(returns == lengths)  # CartPole pays 1 per step
    assert first.agent_info["log_prob"].shape == (64, 4) and np.all(first.agent_info["log_prob"] <= 0)


def test_same_seed_same_samples(cartpole: EnvConfig) -> None:
    import torch

    observations = []
    for _ in range(2):
        torch.manual_seed(0)
        agent = CategoricalPgAgent(probe_spaces(cartpole))
        sampler = SerialSampler(cartpole, batch_T=16, batch_B=2)
        sampler.initialize(agent, seed=7)
        observations.append(sampler.obtain_samples(0).observation.copy())
        sampler.shutdown()
    assert np.array_equal(observations[0], observations[1])


def test_continuous_actions_are_clipped_for_the_env_only() -> None:
    pendulum = EnvConfig(id="Pendulum-v1")
    agent = GaussianPgAgent(probe_spaces(pendulum), init_log_std=2.0)  # wide: many samples out of [-2, 2]
    sampler = SerialSampler(pendulum, batch_T=32, batch_B=2)
    sampler.initialize(agent, seed=0)
    try:
        batch = sampler.obtain_samples(0)
        assert np.abs(batch.action).max() > 2.0  # stored unclipped so log-probs stay exact
        assert np.all(np.isfinite(batch.reward))
    finally:
        sampler.shutdown()


def test_evaluator_runs_deterministic_episodes(cartpole: EnvConfig) -> None:
    agent = CategoricalPgAgent(probe_spaces(cartpole))
    evaluator = Evaluator(cartpole, n_episodes=3, seed=0)
    try:
        returns, lengths = evaluator.evaluate(agent)
    finally:
        evaluator.close()
    assert returns.shape == (3,) and np.all(lengths >= 1) and np.all(returns == lengths)


def test_episode_totals_are_the_sums_of_the_stored_rewards() -> None:
    """Pendulum's float rewards and 200-step truncation: the collector's per-time-step
    accounting (rewards gathered over the envs, totals kept per env) matches the rows."""
    pendulum = EnvConfig(id="Pendulum-v1")
    sampler = SerialSampler(pendulum, batch_T=250, batch_B=3)
    sampler.initialize(GaussianPgAgent(probe_spaces(pendulum)), seed=1)
    try:
        batch = sampler.obtain_samples(0)
    finally:
        sampler.shutdown()
    assert np.all(batch.truncated[199]) and not batch.truncated[:199].any() and not batch.terminated.any()
    assert np.all(batch.completed_length[199] == 200) and np.all(batch.completed_length[200:] == 0)
    np.testing.assert_allclose(batch.completed_return[199], batch.reward[:200].sum(0), rtol=1e-5)
    assert np.isnan(batch.completed_return[:199]).all() and np.isnan(batch.completed_return[200:]).all()
    assert len(np.unique(batch.reward[0])) == 3  # three envs, three different rewards
