"""rlplex's PPO update against Stable-Baselines3's, on the same weights and the same rollout.

SB3 collects one rollout on CartPole with a short time limit (so that the batch holds
terminations and truncations); the same transitions go into an rlplex `SampleBatch`; both
libraries then run one update from identical weights with the same minibatch order. Any
difference in GAE, bootstrapping at truncations, advantage normalisation, the clipped
losses, gradient clipping or Adam shows up in the parameters.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlplex.agents.pg import CategoricalPgAgent
from rlplex.algos.ppo import PPO, PPOConfig
from rlplex.algos.rl_math import gae
from rlplex.envs import EnvConfig, probe_spaces
from rlplex.samplers.batch import SampleBatch, allocate_batch

sb3 = pytest.importorskip("stable_baselines3")

T, B, GAMMA, LAM, EPOCHS = 32, 8, 0.98, 0.8, 20


def _short_cartpole() -> gym.Env[Any, Any]:
    return gym.make("CartPole-v1", max_episode_steps=12)


def _sb3_model(batch_size: int) -> Any:
    from stable_baselines3.common.vec_env import DummyVecEnv

    venv = DummyVecEnv([_short_cartpole for _ in range(B)])
    venv.seed(3)
    return sb3.PPO(
        "MlpPolicy",
        venv,
        n_steps=T,
        batch_size=batch_size,
        n_epochs=EPOCHS,
        gamma=GAMMA,
        gae_lambda=LAM,
        learning_rate=1e-3,
        clip_range=0.2,
        ent_coef=0.0,
        vf_coef=0.5,
        max_grad_norm=0.5,
        device="cpu",
        seed=1,
    )


def _pairs(agent: CategoricalPgAgent, policy: Any) -> list[tuple[torch.nn.Linear, torch.nn.Linear]]:
    """(rlplex layer, SB3 layer) for every linear layer; rlplex's pi/v MLPs are SB3's
    mlp_extractor policy/value nets followed by action_net/value_net."""
    m, ex = agent.model, policy.mlp_extractor
    return [
        (m.pi[0], ex.policy_net[0]),
        (m.pi[2], ex.policy_net[2]),
        (m.pi[4], policy.action_net),
        (m.v[0], ex.value_net[0]),
        (m.v[2], ex.value_net[2]),
        (m.v[4], policy.value_net),
    ]


def _collect(model: Any, agent: CategoricalPgAgent) -> SampleBatch:
    """One SB3 rollout, recorded step by step into an rlplex batch (reward before SB3 adds
    its truncation bootstrap: rlplex bootstraps from `next_observation` instead)."""
    from stable_baselines3.common.callbacks import BaseCallback

    batch = allocate_batch(agent.spaces, agent.info_spec, T, B)

    class Record(BaseCallback):
        def _on_step(self) -> bool:
            t, local = self.n_calls - 1, self.locals
            infos, dones = local["infos"], local["dones"]
            truncated = np.array([bool(info.get("TimeLimit.truncated", False)) for info in infos])
            next_obs = local["new_obs"].copy()
            for i in np.flatnonzero(dones):
                next_obs[i] = infos[i]["terminal_observation"]
            batch.observation[t] = self.model._last_obs
            batch.action[t] = local["actions"]
            batch.reward[t] = local["rewards"]
            batch.terminated[t] = dones & ~truncated
            batch.truncated[t] = truncated
            batch.next_observation[t] = next_obs
            batch.agent_info["log_prob"][t] = local["log_probs"].numpy()
            batch.agent_info["value"][t] = local["values"].numpy().ravel()
            return True

    callback = Record()
    callback.init_callback(model)
    model._setup_learn(T * B, callback=None)
    model.collect_rollouts(model.env, callback, model.rollout_buffer, n_rollout_steps=T)
    return batch


@pytest.mark.parametrize("minibatch_size", [T * B, 64])
def test_ppo_update_matches_stable_baselines3(minibatch_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    model = _sb3_model(minibatch_size)
    agent = CategoricalPgAgent(probe_spaces(EnvConfig(id="CartPole-v1")))
    with torch.no_grad():
        for ours, theirs in _pairs(agent, model.policy):
            ours.weight.copy_(theirs.weight)
            ours.bias.copy_(theirs.bias)
    initial = [ours.weight.detach().clone() for ours, _ in _pairs(agent, model.policy)]
    batch = _collect(model, agent)
    assert batch.truncated.any() and batch.terminated.any(), "the rollout should exercise both episode ends"

    # GAE: rlplex bootstraps truncations from V(next_observation); SB3 folds gamma * V(final
    # observation) into the reward. Same advantages.
    n = T * B
    next_value = agent.value(torch.as_tensor(batch.next_observation.reshape(n, -1))).numpy().reshape(T, B)
    value = batch.agent_info["value"]
    advantage = gae(batch.reward, value, next_value, batch.terminated, batch.truncated, GAMMA, LAM)
    np.testing.assert_allclose(advantage, model.rollout_buffer.advantages, rtol=1e-5, atol=1e-5)

    # The same minibatch order for both: SB3 draws one numpy permutation per epoch, of a buffer
    # flattened env-major (index env * T + t); rlplex flattens time-major (t * B + env).
    np.random.seed(7)
    env_major = [np.random.permutation(n) for _ in range(EPOCHS)]
    orders = [(k % T) * B + k // T for k in env_major]
    np.random.seed(7)
    monkeypatch.setattr(torch, "randperm", lambda size: torch.as_tensor(orders.pop(0)))

    algo = PPO(
        PPOConfig(
            learning_rate=1e-3,
            n_epochs=EPOCHS,
            minibatch_size=minibatch_size,
            gamma=GAMMA,
            gae_lambda=LAM,
            clip_range=0.2,
            value_coef=1.0,  # rlplex's value loss is 0.5 * MSE; SB3's vf_coef 0.5 * MSE
            entropy_coef=0.0,
            max_grad_norm=0.5,
        )
    )
    algo.initialize(agent, n_itr=1000)
    info = algo.optimize_agent(0, batch)
    model._current_progress_remaining = 1.0
    model.train()

    assert algo.update_count == EPOCHS * (n // minibatch_size) and model._n_updates == EPOCHS  # SB3 counts epochs
    for (ours, theirs), before in zip(_pairs(agent, model.policy), initial, strict=True):
        # The update moves every layer by far more than the tolerance (lr 1e-3, 20+ steps).
        assert float((ours.weight.detach() - before).abs().max()) > 1e-3
        np.testing.assert_allclose(ours.weight.detach(), theirs.weight.detach(), rtol=0, atol=2e-6)
        np.testing.assert_allclose(ours.bias.detach(), theirs.bias.detach(), rtol=0, atol=2e-6)
    # Logged the same way: mean policy loss, mean clip fraction over every gradient step.
    assert info["losses/policy"] == pytest.approx(model.logger.name_to_value["train/policy_gradient_loss"], abs=1e-6)
    assert info["losses/clipfrac"] == pytest.approx(model.logger.name_to_value["train/clip_fraction"], abs=1e-6)
