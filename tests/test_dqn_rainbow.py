"""The DQN options: dueling heads, C51's projection and loss, prioritized replay and n-step
returns in the update, exact resume of the full DQN, and the refusals (a continuous action
space, a network that does not match the config, another algorithm's snapshot)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rlplex.agents import DqnAgent, SacAgent
from rlplex.algos import DQN, SAC, DQNConfig, SACConfig
from rlplex.algos.dqn import C51Config, PrioritizedConfig, project_distribution
from rlplex.config import validate_config
from rlplex.envs import EnvConfig, probe_spaces
from rlplex.errors import ConfigError, SnapshotError
from rlplex.io.snapshot import latest_snapshot, read_snapshot, write_snapshot
from rlplex.models import QMlp
from rlplex.replays import PrioritizedReplayBuffer
from rlplex.runners import MinibatchRl
from rlplex.runners.config import TrainConfig, agent_factory, build_runner
from rlplex.samplers import SerialSampler, allocate_batch

CARTPOLE = EnvConfig(id="CartPole-v1")
PENDULUM = EnvConfig(id="Pendulum-v1")
FULL: dict[str, Any] = {"double": True, "dueling": True, "n_step": 3, "prioritized": PrioritizedConfig()}
C51: dict[str, Any] = {"double": True, "n_step": 2, "categorical": C51Config(atoms=11, v_min=0.0, v_max=20.0)}


# ----- networks --------------------------------------------------------------------------------
def test_dueling_heads_give_q_as_value_plus_centred_advantages() -> None:
    torch.manual_seed(0)
    obs = torch.randn(5, 4)
    net = QMlp(4, 3, (16, 8), dueling=True)
    q = net(obs)
    assert q.shape == (5, 3)
    heads = net.head(torch.relu(net.trunk(obs))).view(5, 4)
    value, advantage = heads[:, 0], heads[:, 1:]
    torch.testing.assert_close(q.mean(dim=1), value)  # the advantages are centred
    torch.testing.assert_close(q - q.mean(dim=1, keepdim=True), advantage - advantage.mean(dim=1, keepdim=True))
    c51 = QMlp(4, 3, (16, 8), dueling=True, n_atoms=7, v_min=-1.0, v_max=2.0)
    logits = c51(obs)
    assert logits.shape == (5, 3, 7)
    expected = (torch.softmax(logits, -1) * torch.linspace(-1.0, 2.0, 7)).sum(-1)
    torch.testing.assert_close(c51.q_values(logits), expected)
    agent = DqnAgent(probe_spaces(CARTPOLE), hidden=(16,), dueling=True, n_atoms=7)
    agent.set_epsilon(0.0)
    np.testing.assert_array_equal(agent.step(obs.numpy())[0], agent.eval_step(obs.numpy()))
    assert agent.q_values(obs).shape == (5, 2)


# ----- C51 ---------------------------------------------------------------------------------------
def test_c51_projection_matches_a_hand_example() -> None:
    support = torch.tensor([0.0, 1.0, 2.0])
    probs = torch.tensor([[0.2, 0.3, 0.5]] * 3)
    # r + 0.5 z = 0.5, 1.0, 1.5: 0.2 splits evenly onto 0 and 1, 0.3 lands on 1, 0.5 splits onto 1 and 2;
    # r = 5: everything beyond v_max goes to 2; discount 0 (terminal) with r = 1: all of it on 1.
    projected = project_distribution(probs, torch.tensor([0.5, 5.0, 1.0]), torch.tensor([0.5, 1.0, 0.0]), support)
    torch.testing.assert_close(projected, torch.tensor([[0.1, 0.65, 0.25], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))


# ----- the update -------------------------------------------------------------------------------------
def filled_algo(seed: int, options: dict[str, Any]) -> DQN:
    torch.manual_seed(seed)
    config = DQNConfig(batch_size=8, learning_starts=0, updates_per_itr=4, target_update_interval=3, **options)
    algo = DQN(config, seed=seed)
    algo.initialize(DqnAgent(probe_spaces(CARTPOLE), hidden=(16,), **config.agent_options()), n_itr=10)
    batch = allocate_batch(probe_spaces(CARTPOLE), {}, T=16, B=2)
    rng = np.random.default_rng(seed)
    batch.observation[:] = rng.normal(size=batch.observation.shape)
    batch.next_observation[:-1] = batch.observation[1:]  # consecutive steps: n-step chains form
    batch.next_observation[-1] = rng.normal(size=batch.observation.shape[1:])
    batch.action[:] = rng.integers(0, 2, size=batch.action.shape)
    batch.reward[:] = 1.0
    batch.terminated[:] = rng.random(size=batch.terminated.shape) < 0.1
    batch.truncated[:] = rng.random(size=batch.truncated.shape) < 0.05
    algo.optimize_agent(0, batch)
    return algo


def test_prioritized_update_rewrites_the_priorities_and_anneals_beta() -> None:
    algo = filled_algo(0, FULL)
    replay = algo.replay
    assert isinstance(replay, PrioritizedReplayBuffer)
    leaves = replay.tree.leaves(np.arange(32))
    assert np.all(leaves > 0) and not np.all(leaves == 1.0)  # the sampled ones moved off the start value
    assert algo.beta == pytest.approx(0.4 + 0.6 * 1 / 10)  # after iteration 0 of 10
    assert algo.optimize_agent(9, None)["charts/per_beta"] == pytest.approx(1.0)


@pytest.mark.parametrize("options", [FULL, C51], ids=["double-dueling-per-nstep", "c51"])
def test_resume_from_a_snapshot_equals_the_uninterrupted_run(options: dict[str, Any], tmp_path: Path) -> None:
    original = filled_algo(0, options)
    assert original.agent is not None
    write_snapshot(tmp_path / "s", {"algo": original.state_dict(), "agent": original.agent.model.state_dict()})
    state = read_snapshot(tmp_path / "s")
    resumed = filled_algo(1, options)  # different weights, replay, priorities and RNG until loaded
    assert resumed.agent is not None
    resumed.agent.model.load_state_dict(state["agent"])
    resumed.load_state_dict(state["algo"])
    for itr in (1, 2):
        assert original.optimize_agent(itr, None) == resumed.optimize_agent(itr, None)
    for p, q in zip(original.agent.model.parameters(), resumed.agent.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert resumed.update_count == original.update_count == 12
    if options is FULL:
        assert isinstance(resumed.replay, PrioritizedReplayBuffer) and isinstance(
            original.replay, PrioritizedReplayBuffer
        )
        np.testing.assert_array_equal(resumed.replay.tree.tree, original.replay.tree.tree)
        uniform = DQN(DQNConfig(dueling=True), seed=0)  # the same network, without prioritized replay
        uniform.initialize(DqnAgent(probe_spaces(CARTPOLE), hidden=(16,), dueling=True), n_itr=10)
        with pytest.raises(SnapshotError, match=r"snapshot is of a DQN with .*'prioritized': True"):
            uniform.load_state_dict(state["algo"])


# ----- refusals --------------------------------------------------------------------------------------
def test_dqn_refuses_a_continuous_action_space_and_a_mismatched_network() -> None:
    with pytest.raises(ConfigError, match=r"DQN needs a Discrete action space.*Box\(shape=\(1,\)"):
        DqnAgent(probe_spaces(PENDULUM))
    config = validate_config(
        TrainConfig, {"env": {"id": "Pendulum-v1"}, "algo": {"name": "dqn"}, "runner": {"kind": "sync"}}
    )
    with pytest.raises(ConfigError, match=r"field 'algo.name': DQN needs a Discrete action space, but "
                                          r"'Pendulum-v1' has Box.*use one of ppo, a2c, sac, td3, ddpg"):  # fmt: skip
        build_runner(config, None, show_progress=False)
    config = validate_config(
        TrainConfig, {"env": {"id": "CartPole-v1"}, "algo": {"name": "sac"}, "runner": {"kind": "async"}}
    )
    with pytest.raises(ConfigError, match=r"SAC needs a Box action space, but 'CartPole-v1' has Discrete\(2\)"):
        build_runner(config, None, show_progress=False)
    with pytest.raises(ConfigError, match="agent's has"):
        DQN(DQNConfig(dueling=True)).initialize(DqnAgent(probe_spaces(CARTPOLE)), n_itr=1)
    with pytest.raises(ConfigError, match="v_min"):
        validate_config(TrainConfig, {"env": {"id": "CartPole-v1"},
                                      "algo": {"name": "dqn", "categorical": {"v_min": 1, "v_max": 0}}})  # fmt: skip
    algo = {"name": "dqn", "dueling": True, "categorical": {"atoms": 5}}
    c51 = validate_config(TrainConfig, {"env": {"id": "CartPole-v1"}, "algo": algo})
    model = agent_factory(c51, probe_spaces(CARTPOLE))(probe_spaces(CARTPOLE)).model
    assert isinstance(model, QMlp) and model.dueling and model.n_atoms == 5


def test_a_sac_snapshot_is_refused_by_a_dqn_run(tmp_path: Path) -> None:
    sac = MinibatchRl(
        SAC(SACConfig(batch_size=8, learning_starts=16, critic_hidden=(8,)), seed=0),
        SacAgent(probe_spaces(PENDULUM), hidden=(8,)),
        SerialSampler(PENDULUM, 16, 1), n_steps=32, seed=0, log_dir=tmp_path / "sac", show_progress=False,
    )  # fmt: skip
    sac.train()
    dqn = MinibatchRl(
        DQN(DQNConfig(**FULL), seed=0), DqnAgent(probe_spaces(CARTPOLE), hidden=(8,), dueling=True),
        SerialSampler(CARTPOLE, 16, 1), n_steps=32, seed=0, show_progress=False,
    )  # fmt: skip
    with pytest.raises(SnapshotError, match="snapshot was written by SAC, this run trains DQN"):
        dqn.resume_from(latest_snapshot(tmp_path / "sac" / "snapshots"))
    algo = DQN(DQNConfig(**FULL))
    algo.initialize(DqnAgent(probe_spaces(CARTPOLE), hidden=(8,), dueling=True), n_itr=1)
    with pytest.raises(SnapshotError, match="not a DQN snapshot"):  # also without the runner's record
        algo.load_state_dict(read_snapshot(latest_snapshot(tmp_path / "sac" / "snapshots"))["algo"])


# ----- under AsyncRl: priorities in shared memory ---------------------------------------------------
@pytest.mark.slow
def test_async_runner_trains_the_full_dqn_with_priorities_in_shared_memory(tmp_path: Path) -> None:
    data = {
        "env": {"id": "CartPole-v1"},
        "sampler": {"batch_T": 16, "batch_B": 2},
        "agent": {"hidden": [16]},
        "algo": {"name": "dqn", "batch_size": 16, "learning_starts": 64, "buffer_size": 4096, "dueling": True,
                 "n_step": 3, "prioritized": {"alpha": 0.6}},
        "runner": {"kind": "async", "n_steps": 512, "replay_ratio": 1.0, "log_interval_steps": 128},
    }  # fmt: skip
    result = build_runner(validate_config(TrainConfig, data), tmp_path, show_progress=False).train()
    assert result.env_steps == 512
    assert any("losses/td" in row for row in result.history), result.history
    assert not [p for p in mp.active_children() if p.is_alive()], "child processes left behind"
    replay = read_snapshot(latest_snapshot(tmp_path / "snapshots"))["algo"]["replay"]
    priorities = replay["priorities"]
    # Every slot the copier processes appended got a priority (the top one) in the shared tree;
    # the optimizer's updates moved some of them.
    assert len(priorities) == int(replay["counters"][1]) >= 64
    assert np.all(priorities > 0) and len(np.unique(priorities)) > 1
