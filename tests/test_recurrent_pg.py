"""Recurrent policy-gradient agents (PPO, A2C with an LSTM) and the no-velocity CartPole:
the state resets where episodes end, training replays whole sequences from their stored
start state, the parallel sampler carries each environment's state across batches and
processes, and PPO resumes exactly."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlplex.agents.recurrent import RecurrentCategoricalPgAgent, sequence_resets
from rlplex.algos import A2C, PPO, A2CConfig, PPOConfig
from rlplex.config import validate_config
from rlplex.envs import CARTPOLE_NO_VELOCITY, EnvConfig, make_env, probe_spaces
from rlplex.errors import ConfigError
from rlplex.io.snapshot import read_snapshot, write_snapshot
from rlplex.runners import SyncLauncher
from rlplex.runners.config import TrainConfig, agent_factory
from rlplex.samplers import Evaluator, ParallelSampler, SerialSampler
from rlplex.samplers.batch import SampleBatch
from test_sync_rl import build_seeded

NO_VEL = EnvConfig(id=CARTPOLE_NO_VELOCITY)


def make_agent(seed: int = 0) -> RecurrentCategoricalPgAgent:
    torch.manual_seed(seed)
    return RecurrentCategoricalPgAgent(probe_spaces(NO_VEL), hidden=(16,), lstm_size=8)


def sample(agent: RecurrentCategoricalPgAgent, n: int, T: int = 24, B: int = 4) -> list[SampleBatch]:
    sampler = SerialSampler(NO_VEL, batch_T=T, batch_B=B)
    sampler.initialize(agent, seed=0)
    try:
        return [sampler.obtain_samples(i).copy() for i in range(n)]
    finally:
        sampler.shutdown()


def test_no_velocity_cartpole_is_cartpole_with_x_and_theta_only() -> None:
    partial, full = make_env(NO_VEL), gym.make("CartPole-v1")
    obs, _ = partial.reset(seed=3)
    full_obs, _ = full.reset(seed=3)
    assert partial.observation_space.shape == (2,)
    for action in [0, 1, 1, 0, 1]:
        np.testing.assert_array_equal(obs, full_obs[[0, 2]])
        obs, reward, term, trunc, _ = partial.step(action)
        full_obs, full_reward, full_term, full_trunc, _ = full.step(action)
        assert (reward, term, trunc) == (full_reward, full_term, full_trunc)
    assert partial.spec is not None and partial.spec.max_episode_steps == 500


def test_state_restarts_at_zero_after_an_episode_ends_and_only_there() -> None:
    batch = sample(make_agent(), 1, T=64)[0]
    h = batch.agent_info["rnn_h"]
    done = batch.terminated | batch.truncated
    assert done[:-1].any(), "no episode ended: lengthen the batch"
    assert np.all(h[0] == 0)  # the first step of the run starts from zero
    after_end = sequence_resets(batch.terminated, batch.truncated)
    assert np.all(h[after_end] == 0)
    inside = ~after_end
    inside[0] = False
    assert np.all(np.abs(h[inside]).sum(-1) > 0)  # carried everywhere else


def test_training_replays_whole_sequences_in_time_order_from_their_start_state() -> None:
    agent = make_agent()
    first, second = sample(agent, 2)
    # The second batch starts mid-episode: its stored start state is not zero, and replaying
    # each environment's sequence from it gives back the log-probs and values of sampling.
    assert np.abs(second.agent_info["rnn_h"][0]).sum() > 0
    batch = agent.training_batch(second, log_prob=second.agent_info["log_prob"], value=second.agent_info["value"])
    assert batch["observation"].shape == (4, 24, 2) and batch["rnn_h"].shape == (4, 16)  # policy's and value's
    np.testing.assert_array_equal(batch["observation"][2].numpy(), second.observation[:, 2])  # env 2, in time order
    log_prob, _, value = agent.evaluate_batch(batch)
    torch.testing.assert_close(log_prob, batch["log_prob"])
    torch.testing.assert_close(value, batch["value"])
    # A minibatch of some environments, in any order, replays the same.
    idx = torch.tensor([3, 1])
    log_prob_mb, _, _ = agent.evaluate_batch({k: v[idx] for k, v in batch.items()})
    torch.testing.assert_close(log_prob_mb, batch["log_prob"][idx])
    # From a zero state instead, the replay differs: the stored start state matters.
    zeroed = {**batch, "rnn_h": torch.zeros_like(batch["rnn_h"]), "rnn_c": torch.zeros_like(batch["rnn_c"])}
    assert not torch.allclose(agent.evaluate_batch(zeroed)[0], batch["log_prob"])
    # Bootstrap values: V(next_observation[t]) with the state after step t, which inside an
    # episode is the next step's own value.
    next_value = agent.next_values(second)
    inside = ~(second.terminated | second.truncated)[:-1]
    np.testing.assert_allclose(next_value[:-1][inside], second.agent_info["value"][1:][inside], atol=1e-6)
    del first


def test_evaluation_keeps_its_own_state() -> None:
    agent = make_agent()
    batch_state = sample(agent, 1)[0]
    state_before = agent._state
    evaluator = Evaluator(NO_VEL, n_episodes=2, seed=0)
    try:
        first = evaluator.evaluate(agent)
        assert agent._state is state_before  # the sampler's state is untouched
        evaluator.calls = 0  # the same seeds again: a fresh state gives the same episodes
        assert np.array_equal(evaluator.evaluate(agent)[0], first[0])
    finally:
        evaluator.close()
    del batch_state


def replay_states(agent: RecurrentCategoricalPgAgent, batches: list[SampleBatch]) -> tuple[np.ndarray, np.ndarray]:
    """The LSTM state before every step and the log-probs, recomputed from a zero state over the
    batches joined in time, resetting after every episode end."""
    obs = torch.as_tensor(np.concatenate([b.observation for b in batches]))
    term = np.concatenate([b.terminated for b in batches])
    trunc = np.concatenate([b.truncated for b in batches])
    reset = torch.as_tensor(sequence_resets(term, trunc))
    net = agent.net
    B = obs.shape[1]
    zeros = (torch.zeros(B, 16), torch.zeros(B, 16))
    h_pi, _ = net.pi_trunk.states_after_each_step(obs, net.split(zeros)[0], reset)
    h_v, _ = net.v_trunk.states_after_each_step(obs, net.split(zeros)[1], reset)
    h = torch.cat((h_pi, h_v), -1)
    before = torch.cat([torch.zeros(1, B, h.shape[-1]), h[:-1]]) * (~reset).unsqueeze(-1)
    with torch.no_grad():
        logits, _, _ = net(obs, zeros, reset)
    actions = torch.as_tensor(np.concatenate([b.action for b in batches]))
    log_prob, _ = agent.log_prob_entropy(logits, actions)
    return before.numpy(), log_prob.numpy()


@pytest.mark.slow
def test_parallel_sampler_carries_each_environments_state_across_batches_and_processes() -> None:
    agent = make_agent()
    factory = partial(RecurrentCategoricalPgAgent, hidden=(16,), lstm_size=8)
    sampler = ParallelSampler(NO_VEL, batch_T=16, batch_B=4, n_workers=2, agent_factory=factory)
    sampler.initialize(agent, seed=0)
    try:
        batches = [sampler.obtain_samples(i).copy() for i in range(3)]
    finally:
        sampler.shutdown()
    stored_h = np.concatenate([b.agent_info["rnn_h"] for b in batches])
    assert np.abs(stored_h[16]).sum() > 0  # batch 2 starts from the state batch 1 ended with
    assert np.concatenate([b.terminated for b in batches]).any()
    recomputed_h, log_prob = replay_states(agent, batches)
    np.testing.assert_allclose(stored_h, recomputed_h, atol=1e-5)
    np.testing.assert_allclose(np.concatenate([b.agent_info["log_prob"] for b in batches]), log_prob, atol=1e-5)


@pytest.mark.parametrize("algo_name", ["ppo", "a2c"])
def test_resume_from_a_snapshot_equals_the_uninterrupted_run(algo_name: str, tmp_path: Path) -> None:
    def make(seed: int) -> PPO | A2C:
        agent = make_agent(seed)
        algo: PPO | A2C
        if algo_name == "ppo":
            algo = PPO(PPOConfig(n_epochs=2, minibatch_size=48, lr_schedule="linear"))
        else:
            algo = A2C(A2CConfig(optimizer="adam"))
        algo.initialize(agent, n_itr=10)
        return algo

    uninterrupted = make(0)
    assert uninterrupted.agent is not None
    batches = sample(uninterrupted.agent, 4)  # type: ignore[arg-type]
    for itr in (0, 1):
        uninterrupted.optimize_agent(itr, batches[itr])
    write_snapshot(
        tmp_path / "s", {"algo": uninterrupted.state_dict(), "agent": uninterrupted.agent.model.state_dict()}
    )
    state = read_snapshot(tmp_path / "s")
    resumed = make(1)  # other weights until loaded
    assert resumed.agent is not None
    resumed.agent.model.load_state_dict(state["agent"])
    resumed.load_state_dict(state["algo"])
    for itr in (2, 3):
        torch.manual_seed(itr)  # PPO's minibatch order: torch's global generator, which the runner snapshots
        metrics = uninterrupted.optimize_agent(itr, batches[itr])
        torch.manual_seed(itr)
        assert resumed.optimize_agent(itr, batches[itr]) == metrics
    for key, value in uninterrupted.agent.model.state_dict().items():
        assert torch.equal(value, resumed.agent.model.state_dict()[key]), key
    assert resumed.update_count == uninterrupted.update_count


def test_config_builds_the_recurrent_agent_and_refuses_it_elsewhere() -> None:
    config = validate_config(TrainConfig, {"env": {"id": CARTPOLE_NO_VELOCITY}, "agent": {"lstm_size": 16}}, "t.toml")
    agent = agent_factory(config, probe_spaces(config.env))(probe_spaces(config.env))
    assert isinstance(agent, RecurrentCategoricalPgAgent) and agent.state_size == 32
    dqn = validate_config(
        TrainConfig, {"env": {"id": "CartPole-v1"}, "agent": {"lstm_size": 16}, "algo": {"name": "dqn"}}, "t.toml"
    )
    with pytest.raises(ConfigError, match=r"agent\.lstm_size"):
        agent_factory(dqn, probe_spaces(dqn.env))
    box = validate_config(TrainConfig, {"env": {"id": "Pendulum-v1"}, "agent": {"lstm_size": 16}}, "t.toml")
    with pytest.raises(ConfigError, match="Discrete"):
        agent_factory(box, probe_spaces(box.env))


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "a2c"])
def test_recurrent_agents_train_under_sync_rl_with_ranks_in_step(algo: str, tmp_path: Path) -> None:
    """Two real gloo ranks: each samples its own environments with its own LSTM states; the
    all-reduced gradients of whole-sequence minibatches keep the replicas identical."""
    extra = {"n_epochs": 2, "minibatch_size": 32} if algo == "ppo" else {}
    config = TrainConfig.model_validate(
        {
            "env": {"id": CARTPOLE_NO_VELOCITY},
            "agent": {"hidden": [16], "lstm_size": 16},
            "sampler": {"batch_T": 16, "batch_B": 2},
            "algo": {"name": algo, **extra},
            "runner": {"kind": "sync", "n_steps": 256, "log_interval_steps": 128, "world_size": 2},
        }
    )
    launcher = SyncLauncher(partial(build_seeded, config, str(tmp_path)), world_size=2, timeout_s=120)
    assert launcher.train().env_steps == 256
    r0, r1 = (outcome.digests or {} for outcome in launcher.rank_outcomes)
    assert r0["built"] != r1["built"], "the builder gives the ranks different initial weights"
    assert r0["start"] == r1["start"] == r0["built"], "rank 0's weights are broadcast"
    assert r0["final"] == r1["final"] != r0["start"], "all-reduced gradients keep the replicas identical"
