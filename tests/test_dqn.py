"""DQN: the double-DQN target, epsilon-greedy acting, the epsilon schedule, exact resume, learning."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from rlplex.agents import DqnAgent
from rlplex.algos import DQN, DQNConfig
from rlplex.algos.dqn import td_target
from rlplex.config import validate_config
from rlplex.envs import EnvConfig, EnvSpaces, probe_spaces
from rlplex.errors import ConfigError
from rlplex.io.snapshot import latest_snapshot, read_snapshot, write_snapshot
from rlplex.runners import MinibatchRl, MinibatchRlEval
from rlplex.runners.config import TrainConfig, agent_factory, build_algo
from rlplex.samplers import Evaluator, SerialSampler, allocate_batch

CARTPOLE = EnvConfig(id="CartPole-v1")
SPACES = EnvSpaces(obs_shape=(1,), action_kind="discrete", n_actions=2, action_shape=())


class TableQ(nn.Module):
    """Q-values looked up by the (integer) observation: a hand-made network for target maths."""

    def __init__(self, table: list[list[float]]) -> None:
        super().__init__()
        self.table = torch.tensor(table)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.table[obs[:, 0].long()]


def test_double_dqn_target_uses_online_argmax_and_target_values() -> None:
    batch = {
        "next_observation": torch.tensor([[0.0], [1.0]]),
        "reward": torch.tensor([1.0, 2.0]),
        "terminated": torch.tensor([False, True]),
    }
    online = TableQ([[5.0, 1.0], [3.0, 2.0]])  # argmax: action 0 for state 0
    target = TableQ([[10.0, 20.0], [30.0, 40.0]])
    double = td_target(batch, online, target, gamma=0.5, double=True)
    plain = td_target(batch, online, target, gamma=0.5, double=False)
    torch.testing.assert_close(double, torch.tensor([1.0 + 0.5 * 10.0, 2.0]))  # terminal: no bootstrap
    torch.testing.assert_close(plain, torch.tensor([1.0 + 0.5 * 20.0, 2.0]))


def test_epsilon_schedule_decays_linearly_then_stays() -> None:
    algo = DQN(DQNConfig(exploration_fraction=0.1, eps_initial=1.0, eps_final=0.04))
    algo.initialize(DqnAgent(SPACES), n_itr=100)
    assert algo.epsilon_at(0) == pytest.approx(1.0)
    assert algo.epsilon_at(5) == pytest.approx(0.52)
    assert algo.epsilon_at(10) == pytest.approx(0.04)
    assert algo.epsilon_at(90) == pytest.approx(0.04)


def test_agent_acts_greedily_at_epsilon_zero_and_uniformly_at_one() -> None:
    torch.manual_seed(0)
    agent = DqnAgent(probe_spaces(CARTPOLE), hidden=(8,))
    obs = np.random.default_rng(0).normal(size=(2000, 4)).astype(np.float32)
    agent.set_epsilon(0.0)
    action, info = agent.step(obs)
    assert info == {}
    np.testing.assert_array_equal(action, agent.eval_step(obs))
    agent.set_epsilon(1.0)
    assert 0.45 < agent.step(obs)[0].mean() < 0.55
    # epsilon travels with the weights, as a sampler process receives them
    copy = DqnAgent(probe_spaces(CARTPOLE), hidden=(8,))
    copy.model.load_state_dict(agent.model.state_dict())
    assert copy.epsilon == 1.0


def filled_algo(seed: int) -> DQN:
    torch.manual_seed(seed)
    algo = DQN(DQNConfig(batch_size=8, learning_starts=0, updates_per_itr=4, target_update_interval=3), seed=seed)
    algo.initialize(DqnAgent(probe_spaces(CARTPOLE), hidden=(16,)), n_itr=10)
    batch = allocate_batch(probe_spaces(CARTPOLE), {}, T=16, B=2)
    rng = np.random.default_rng(seed)
    batch.observation[:] = rng.normal(size=batch.observation.shape)
    batch.next_observation[:] = rng.normal(size=batch.observation.shape)
    batch.action[:] = rng.integers(0, 2, size=batch.action.shape)
    batch.reward[:] = 1.0
    batch.terminated[:] = rng.random(size=batch.terminated.shape) < 0.1
    algo.optimize_agent(0, batch)
    return algo


def test_algo_state_resumes_exactly_through_a_snapshot(tmp_path: Path) -> None:
    original = filled_algo(seed=0)
    assert original.agent is not None
    write_snapshot(tmp_path / "s", {"algo": original.state_dict(), "agent": original.agent.model.state_dict()})
    state = read_snapshot(tmp_path / "s")
    resumed = filled_algo(seed=1)  # different weights, replay and RNG until loaded
    assert resumed.agent is not None
    resumed.agent.model.load_state_dict(state["agent"])
    resumed.load_state_dict(state["algo"])
    for itr in (1, 2):
        a, b = original.optimize_agent(itr, None), resumed.optimize_agent(itr, None)
        assert a == b
    for p, q in zip(original.agent.model.parameters(), resumed.agent.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert resumed.update_count == original.update_count == 12
    assert resumed.replay is not None and resumed.replay.total_appended == 32


def dqn_runner(log_dir: Path, n_steps: int) -> MinibatchRl:
    spaces = probe_spaces(CARTPOLE)
    config = DQNConfig(batch_size=16, learning_starts=64, updates_per_itr=2, exploration_fraction=0.5)
    return MinibatchRl(
        DQN(config, seed=0), DqnAgent(spaces, hidden=(16,)), SerialSampler(CARTPOLE, 16, 2),
        n_steps=n_steps, seed=0, log_interval_steps=64, log_dir=log_dir, snapshot_mode="all", show_progress=False,
    )  # fmt: skip


def test_runner_resume_continues_epsilon_counters_and_replay(tmp_path: Path) -> None:
    first = dqn_runner(tmp_path / "a", n_steps=320)  # 10 iterations of 32 steps
    first.train()
    snap = tmp_path / "a" / "snapshots" / "itr_3"  # after 128 env steps
    saved = read_snapshot(snap)
    saved_eps = float(saved["agent"]["epsilon"])
    assert 0.04 < saved_eps < 1.0
    resumed = dqn_runner(tmp_path / "b", n_steps=320)
    resumed.resume_from(snap)
    resumed.startup()
    try:
        algo = resumed.algo
        assert isinstance(algo, DQN) and algo.agent is not None and algo.replay is not None
        assert algo.agent.epsilon == pytest.approx(saved_eps)  # not back at 1
        assert algo.update_count == int(saved["algo"]["update_count"]) > 0
        assert (algo.replay.size, algo.replay.total_appended) == (128, 128)
        assert resumed.start_itr == 4
    finally:
        resumed.shutdown()
    result = resumed.train()
    assert result.env_steps == 320
    final_first = read_snapshot(latest_snapshot(tmp_path / "a" / "snapshots"))
    final_resumed = read_snapshot(latest_snapshot(tmp_path / "b" / "snapshots"))
    assert final_resumed["algo"]["update_count"] == final_first["algo"]["update_count"]
    assert float(final_resumed["agent"]["epsilon"]) == pytest.approx(float(final_first["agent"]["epsilon"]))
    assert int(final_resumed["algo"]["replay"]["counters"][2]) == 320


def test_config_builds_dqn_and_rejects_fields_of_another_algorithm() -> None:
    config = validate_config(TrainConfig, {"env": {"id": "CartPole-v1"}, "algo": {"name": "dqn", "batch_size": 32}})
    algo = build_algo(config)
    assert isinstance(algo, DQN) and algo.config.batch_size == 32
    assert isinstance(agent_factory(config, probe_spaces(CARTPOLE))(probe_spaces(CARTPOLE)), DqnAgent)
    with pytest.raises(ConfigError, match="clip_range"):
        validate_config(TrainConfig, {"env": {"id": "CartPole-v1"}, "algo": {"name": "dqn", "clip_range": 0.2}})


def test_dqn_learns_cartpole_beyond_random_in_a_small_budget() -> None:
    """Smoke version of benchmarks/learn_dqn_cartpole.py: a random policy scores about 20."""
    torch.manual_seed(0)
    spaces = probe_spaces(CARTPOLE)
    config = DQNConfig(learning_rate=2.3e-3, batch_size=64, learning_starts=1000, updates_per_itr=64,
                       target_update_interval=64, exploration_fraction=0.3, eps_final=0.04)  # fmt: skip
    runner = MinibatchRlEval(
        DQN(config, seed=0), DqnAgent(spaces, hidden=(64, 64)), SerialSampler(CARTPOLE, 32, 4),
        n_steps=30_000, seed=0, log_interval_steps=5120, snapshot_mode="none", stop_at_return=150.0,
        show_progress=False, evaluator=Evaluator(CARTPOLE, n_episodes=5, seed=0),
    )  # fmt: skip
    result = runner.train()
    best = max(row["charts/eval_return_mean"] for row in result.history)
    assert best >= 150.0, [row["charts/eval_return_mean"] for row in result.history]
