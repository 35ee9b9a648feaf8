"""SAC, TD3 and DDPG on Pendulum-v1: the squashed Gaussian, acting, TD3's delays, exact resume,
the runner and the config. Learning itself is measured by benchmarks/classic_learning.py."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rlplex.agents import DdpgAgent, RandomAgent, SacAgent
from rlplex.algos import SAC, TD3, DDPGConfig, SACConfig, TD3Config
from rlplex.config import validate_config
from rlplex.envs import EnvConfig, probe_spaces
from rlplex.errors import ConfigError, RlplexError
from rlplex.io.snapshot import latest_snapshot, read_snapshot, write_snapshot
from rlplex.models.continuous import QEnsemble
from rlplex.runners import MinibatchRl
from rlplex.runners.config import TrainConfig, agent_factory, build_algo, build_runner
from rlplex.samplers import SerialSampler
from rlplex.samplers.batch import SampleBatch

PENDULUM = EnvConfig(id="Pendulum-v1")
SPACES = probe_spaces(PENDULUM)
SMALL: dict[str, Any] = {"batch_size": 16, "learning_starts": 0, "updates_per_itr": 3, "critic_hidden": (16,)}


def make_algo(name: str, seed: int) -> SAC | TD3:
    """An initialized algorithm with a small agent; weights drawn from `seed`."""
    torch.manual_seed(seed)
    if name == "sac":
        sac = SAC(SACConfig(**SMALL), seed=seed)
        sac.initialize(SacAgent(SPACES, hidden=(16,)), n_itr=10)
        return sac
    config = TD3Config(**SMALL) if name == "td3" else DDPGConfig(**SMALL)
    td3 = TD3(config, seed=seed)
    td3.initialize(DdpgAgent(SPACES, hidden=(16,)), n_itr=10)
    return td3


def pendulum_batches(n: int) -> list[SampleBatch]:
    """Real Pendulum-v1 transitions (uniform random actions), copied out of the sampler."""
    sampler = SerialSampler(PENDULUM, batch_T=16, batch_B=2)
    sampler.initialize(RandomAgent(SPACES, seed=0), seed=0)
    try:
        return [sampler.obtain_samples(i).copy() for i in range(n)]
    finally:
        sampler.shutdown()


def test_squashed_gaussian_log_prob_equals_torch_tanh_transformed_normal() -> None:
    torch.manual_seed(0)
    actor = SacAgent(SPACES, hidden=(16,)).actor
    obs = torch.randn(64, 3) * 3
    action, log_prob = actor.sample(obs, torch.Generator().manual_seed(0))
    mean, log_std = actor(obs)
    dist = torch.distributions.TransformedDistribution(
        torch.distributions.Normal(mean, log_std.exp()), [torch.distributions.TanhTransform()]
    )
    expected = dist.log_prob(action.clamp(-1 + 1e-6, 1 - 1e-6)).sum(-1)
    assert action.abs().max() <= 1.0
    torch.testing.assert_close(log_prob, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("agent_class", [SacAgent, DdpgAgent])
def test_agents_act_uniformly_before_learning_starts_then_from_the_policy(agent_class: type) -> None:
    torch.manual_seed(0)
    agent = agent_class(SPACES, hidden=(16,))
    obs = np.random.default_rng(0).normal(size=(4000, 3)).astype(np.float32)
    random_action, info = agent.step(obs)
    assert info == {} and random_action.shape == (4000, 1)
    assert -2.0 <= random_action.min() < -1.9 and 1.9 < random_action.max() <= 2.0  # Pendulum's bounds
    assert abs(float(random_action.mean())) < 0.1
    agent.set_random_actions(False)
    greedy = agent.eval_step(obs)
    np.testing.assert_array_equal(greedy, agent.eval_step(obs))
    noisy, _ = agent.step(obs)
    assert np.abs(noisy).max() <= 2.0 and not np.array_equal(noisy, greedy)
    # the switch travels with the weights, as a sampler process receives them
    copy = agent_class(SPACES, hidden=(16,))
    copy.model.load_state_dict(agent.model.state_dict())
    np.testing.assert_array_equal(copy.eval_step(obs), greedy)
    assert float(copy.actor.random_actions) == 0.0


def test_ddpg_agent_noise_has_the_configured_std_in_normalised_units() -> None:
    torch.manual_seed(0)
    agent = DdpgAgent(SPACES, hidden=(16,), exploration_noise=0.1)
    agent.set_random_actions(False)
    obs = np.zeros((20_000, 3), dtype=np.float32)  # the untrained actor's action at 0 is well inside the bounds
    noise = agent.step(obs)[0] - agent.eval_step(obs)
    assert float(noise.std()) == pytest.approx(0.1 * 2.0, rel=0.05)  # Pendulum's half-range is 2


def test_td3_updates_the_actor_and_targets_every_policy_delay_steps() -> None:
    algo = make_algo("td3", seed=0)
    assert isinstance(algo, TD3) and algo.agent is not None
    algo.replay.append_samples(algo.sampler_to_buffer(pendulum_batches(1)[0]))  # type: ignore[union-attr]
    actor = [p.clone() for p in algo.agent.model.parameters()]
    critic_target = [p.clone() for p in algo.critic_target.parameters()]
    algo.optimize_agent(0, None, n_updates=1)
    assert all(torch.equal(a, b) for a, b in zip(actor, algo.agent.model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(critic_target, algo.critic_target.parameters(), strict=True))
    metrics = algo.optimize_agent(1, None, n_updates=1)
    assert not any(torch.equal(a, b) for a, b in zip(actor, algo.agent.model.parameters(), strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(critic_target, algo.critic_target.parameters(), strict=True))
    assert "losses/actor" in metrics and algo.update_count == 2


def test_ddpg_is_td3_with_one_critic_no_smoothing_no_delay() -> None:
    algo = make_algo("ddpg", seed=0)
    assert isinstance(algo, TD3) and algo.critic.n == 1
    assert (algo.config.policy_delay, algo.config.target_policy_noise) == (1, 0.0)
    assert make_algo("td3", seed=0).critic.n == 2  # type: ignore[union-attr]


def test_sac_tunes_alpha_towards_the_target_entropy() -> None:
    up, down = make_algo("sac", seed=0), make_algo("sac", seed=0)
    assert isinstance(up, SAC) and isinstance(down, SAC)
    up.target_entropy, down.target_entropy = 10.0, -10.0  # far above / below the policy's entropy
    batch = pendulum_batches(1)[0]
    up_metrics, down_metrics = up.optimize_agent(0, batch), down.optimize_agent(0, batch)
    assert float(up.log_alpha.detach().exp()) > up_metrics["charts/alpha"] > 1.0  # alpha starts at 1 (init_ent_coef)
    assert float(down.log_alpha.detach().exp()) < down_metrics["charts/alpha"] < 1.0


@pytest.mark.parametrize("name", ["sac", "td3", "ddpg"])
def test_resume_from_a_snapshot_equals_the_uninterrupted_run(name: str, tmp_path: Path) -> None:
    batches = pendulum_batches(4)
    uninterrupted = make_algo(name, seed=0)
    for itr in (0, 1):
        uninterrupted.optimize_agent(itr, batches[itr])
    assert uninterrupted.agent is not None
    write_snapshot(
        tmp_path / "s", {"algo": uninterrupted.state_dict(), "agent": uninterrupted.agent.model.state_dict()}
    )
    state = read_snapshot(tmp_path / "s")
    resumed = make_algo(name, seed=1)  # other weights, critics, replay and random streams until loaded
    assert resumed.agent is not None
    resumed.agent.model.load_state_dict(state["agent"])
    resumed.load_state_dict(state["algo"])
    for itr in (2, 3):
        assert uninterrupted.optimize_agent(itr, batches[itr]) == resumed.optimize_agent(itr, batches[itr])
    for a, b in ((uninterrupted.agent.model, resumed.agent.model), (uninterrupted.critic, resumed.critic),
                 (uninterrupted.critic_target, resumed.critic_target)):  # fmt: skip
        for key, value in a.state_dict().items():
            assert torch.equal(value, b.state_dict()[key]), key
    assert resumed.update_count == uninterrupted.update_count == 12
    if isinstance(uninterrupted, SAC) and isinstance(resumed, SAC):
        assert torch.equal(uninterrupted.log_alpha, resumed.log_alpha)


def sac_runner(log_dir: Path) -> MinibatchRl:
    config = SACConfig(batch_size=16, learning_starts=48, updates_per_itr=2, critic_hidden=(16,))
    return MinibatchRl(
        SAC(config, seed=0), SacAgent(SPACES, hidden=(16,)), SerialSampler(PENDULUM, 16, 2),
        n_steps=192, seed=0, log_interval_steps=32, log_dir=log_dir, snapshot_mode="all", show_progress=False,
    )  # fmt: skip


def test_runner_resume_restores_critics_alpha_replay_and_the_acting_switch(tmp_path: Path) -> None:
    sac_runner(tmp_path / "a").train()
    snap = tmp_path / "a" / "snapshots" / "itr_2"  # after 96 env steps, past learning_starts
    saved = read_snapshot(snap)
    resumed = sac_runner(tmp_path / "b")
    resumed.resume_from(snap)
    resumed.startup()
    try:
        algo = resumed.algo
        assert isinstance(algo, SAC) and algo.replay is not None and algo.agent is not None
        assert algo.replay.size == 96 and algo.update_count == int(saved["algo"]["update_count"]) > 0
        assert float(algo.agent.actor.random_actions) == 0.0
        assert torch.equal(algo.log_alpha.detach(), saved["algo"]["log_alpha"])
        for key, value in algo.critic_target.state_dict().items():
            assert torch.equal(value, saved["algo"]["critic_target"][key]), key
        assert resumed.start_itr == 3
    finally:
        resumed.shutdown()
    assert resumed.train().env_steps == 192
    final_a = read_snapshot(latest_snapshot(tmp_path / "a" / "snapshots"))
    final_b = read_snapshot(latest_snapshot(tmp_path / "b" / "snapshots"))
    assert final_b["algo"]["update_count"] == final_a["algo"]["update_count"]
    assert int(final_b["algo"]["replay"]["counters"][2]) == 192


def test_config_builds_each_algorithm_and_refuses_what_it_cannot_run() -> None:
    def config(algo: dict[str, Any], **runner: Any) -> TrainConfig:
        return validate_config(TrainConfig, {"env": {"id": "Pendulum-v1"}, "algo": algo, "runner": runner})

    for name, algo_class, agent_class in (("sac", SAC, SacAgent), ("td3", TD3, DdpgAgent), ("ddpg", TD3, DdpgAgent)):
        built = config({"name": name, "batch_size": 32})
        algo = build_algo(built)
        assert isinstance(algo, algo_class) and algo.config.batch_size == 32
        assert isinstance(agent_factory(built, SPACES)(SPACES), agent_class)
    assert build_algo(config({"name": "ddpg"})).config.n_critics == 1
    with pytest.raises(ConfigError, match="policy_delay"):
        config({"name": "sac", "policy_delay": 2})
    with pytest.raises(ConfigError, match="ent_coef"):
        config({"name": "sac", "ent_coef": "sometimes"})
    with pytest.raises(ConfigError, match=r"runner\.kind"):
        build_runner(config({"name": "td3"}, kind="sync"), None, show_progress=False)
    with pytest.raises(RlplexError, match="SacAgent"):
        SAC().initialize(DdpgAgent(SPACES), n_itr=1)
    cartpole = validate_config(TrainConfig, {"env": {"id": "CartPole-v1"}, "algo": {"name": "sac"}})
    with pytest.raises(ConfigError, match="Box action space"):
        agent_factory(cartpole, probe_spaces(cartpole.env))(probe_spaces(cartpole.env))


def test_q_ensemble_members_are_independent_critics() -> None:
    critic = QEnsemble(3, 1, (8, 8), n=3, generator=torch.Generator().manual_seed(0))
    obs, action = torch.randn(5, 3), torch.rand(5, 1)
    q = critic(obs, action)
    assert q.shape == (3, 5)
    for i in range(3):  # member i equals an nn.Linear/ReLU MLP with its slice of the weights
        layers = []
        for weight, bias in zip(critic.weights, critic.biases, strict=True):
            linear = torch.nn.Linear(weight.shape[1], weight.shape[2])
            linear.weight.data, linear.bias.data = weight[i].t(), bias[i, 0]
            layers += [linear, torch.nn.ReLU()]
        torch.testing.assert_close(q[i], torch.nn.Sequential(*layers[:-1])(torch.cat((obs, action), -1)).squeeze(-1))
    torch.testing.assert_close(critic(obs, action, first=1), q[:1])


@pytest.mark.slow
def test_async_runner_trains_sac_with_real_sampler_and_copier_processes(tmp_path: Path) -> None:
    """TD3/DDPG have the same replay-algorithm interface; one async run (about 20 s on 2 busy cores) covers it."""
    data = {
        "env": {"id": "Pendulum-v1"},
        "sampler": {"batch_T": 16, "batch_B": 2},
        "agent": {"hidden": [16]},
        "algo": {"name": "sac", "batch_size": 16, "learning_starts": 64, "critic_hidden": [16]},
        # The floor keeps the learner in step on a busy machine: unthrottled, the sampler once took
        # all 512 steps before the first update, and nothing was trained.
        "runner": {"kind": "async_eval", "n_steps": 512, "replay_ratio": 1.0, "min_replay_ratio": 0.5,
                   "log_interval_steps": 128, "eval_episodes": 1},
    }  # fmt: skip
    runner = build_runner(validate_config(TrainConfig, data), tmp_path, show_progress=False)
    result = runner.train()
    assert result.env_steps == 512
    assert any("losses/critic" in row for row in result.history), result.history
    assert not [p for p in mp.active_children() if p.is_alive()], "child processes left behind"
    snap = read_snapshot(latest_snapshot(tmp_path / "snapshots"))
    assert int(snap["algo"]["replay"]["counters"][2]) >= 64 and float(snap["agent"]["random_actions"]) == 0.0
