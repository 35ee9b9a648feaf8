from __future__ import annotations

import numpy as np
import pytest
import torch

from rlplex.agents.pg import CategoricalPgAgent, GaussianPgAgent, PgAgent
from rlplex.algos.pg_batch import clip_grad_norm, gae_advantages
from rlplex.algos.ppo import PPO, PPOConfig, fused_update_supported
from rlplex.envs import EnvConfig, probe_spaces
from rlplex.errors import RlplexError
from rlplex.models import ActorCriticMlp, QMlp
from rlplex.samplers.batch import SampleBatch, allocate_batch


def test_gae_bootstraps_through_truncation_but_not_termination() -> None:
    gamma, lam = 0.5, 0.5
    # env 0: t=1 is truncated (time limit: bootstrap with V(next_obs)=2), t=2 terminated (no bootstrap).
    # env 1: no episode end, so the last step bootstraps with next_value 2.
    reward = np.array([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]], dtype=np.float32)
    value = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]], dtype=np.float32)
    next_value = np.array([[1.0, 0.0], [2.0, 0.0], [4.0, 2.0]], dtype=np.float32)
    terminated = np.array([[False, False], [False, False], [True, False]])
    truncated = np.array([[False, False], [True, False], [False, False]])

    adv = gae_advantages(reward, value, next_value, terminated, truncated, gamma, lam)

    # env 0: deltas 1+0.5*1-1=0.5, 1+0.5*2-1=1.0, 1+0-1=0; the truncation cuts the trace at t=1.
    # env 1: deltas 1, 1, 1+0.5*2=2; A2=2, A1=1+0.25*2, A0=1+0.25*1.5.
    expected = np.array([[0.5 + 0.25 * 1.0, 1.375], [1.0, 1.5], [0.0, 2.0]], dtype=np.float32)
    np.testing.assert_allclose(adv, expected, rtol=1e-6)


def test_gae_with_lambda_one_and_no_dones_is_discounted_return_minus_value() -> None:
    rng = np.random.default_rng(0)
    reward = rng.normal(size=(5, 1)).astype(np.float32)
    value = rng.normal(size=(5, 1)).astype(np.float32)
    next_value = np.zeros((5, 1), dtype=np.float32)
    next_value[:-1] = value[1:]
    next_value[-1] = 0.7
    no = np.zeros((5, 1), dtype=bool)
    adv = gae_advantages(reward, value, next_value, no, no, gamma=0.9, lam=1.0)
    ret = 0.7
    for t in range(4, -1, -1):
        ret = reward[t, 0] + 0.9 * ret
        np.testing.assert_allclose(adv[t, 0], ret - value[t, 0], rtol=1e-5)


def test_clip_grad_norm_equals_torch_clip_grad_norm() -> None:
    torch.manual_seed(0)
    model = ActorCriticMlp(4, 2)
    out, value = model(torch.randn(32, 4))
    (out.pow(2).sum() * 100 + value.sum()).backward()  # a gradient norm well above the limit
    params = list(model.parameters())
    grads = [p.grad.clone() for p in params if p.grad is not None]
    expected = [g.clone() for g in grads]
    reference = [torch.nn.Parameter(torch.zeros_like(g)) for g in expected]
    for p, g in zip(reference, expected, strict=True):
        p.grad = g
    torch.nn.utils.clip_grad_norm_(reference, 0.5, foreach=True)
    clip_grad_norm(params, 0.5)
    assert float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) > 0.5
    for p, r in zip(params, reference, strict=True):
        assert torch.equal(p.grad, r.grad)


@pytest.mark.parametrize("model", [ActorCriticMlp(4, 3), QMlp(4, 3)])
def test_functional_mlp_forward_equals_module_calls(model: torch.nn.Module) -> None:
    x = torch.randn(16, 4)
    ours = model(x)
    if isinstance(model, ActorCriticMlp):
        assert torch.equal(ours[0], model.pi(x)) and torch.equal(ours[1], model.v(x).squeeze(-1))
    else:
        assert torch.equal(ours, model.q(x))


def _random_batch(agent: PgAgent, T: int, B: int, seed: int) -> SampleBatch:
    """A [T, B] batch with random observations and actions and the agent's own log-probs."""
    rng = np.random.default_rng(seed)
    batch = allocate_batch(agent.spaces, agent.info_spec, T, B)
    batch.observation[:] = rng.normal(size=batch.observation.shape)
    batch.next_observation[:] = rng.normal(size=batch.next_observation.shape)
    batch.reward[:] = rng.normal(size=(T, B))
    batch.terminated[:] = rng.random((T, B)) < 0.05
    batch.truncated[:] = rng.random((T, B)) < 0.05
    for t in range(T):
        action, info = agent.step(batch.observation[t])
        batch.action[t] = action
        batch.agent_info["log_prob"][t] = info["log_prob"] + rng.normal(scale=0.2, size=B)  # some clipping
        batch.agent_info["value"][t] = info["value"]
    return batch


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
@pytest.mark.parametrize("minibatch_size", [64, 256])
def test_fused_update_equals_autograd_update(env_id: str, minibatch_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """PPO's closed-form gradients (rlplex's own agents) against autograd's, entropy bonus included."""
    spaces = probe_spaces(EnvConfig(id=env_id))
    config = PPOConfig(learning_rate=1e-3, n_epochs=4, minibatch_size=minibatch_size, entropy_coef=0.05)
    results = []
    for fused in (True, False):
        torch.manual_seed(0)
        agent: PgAgent = CategoricalPgAgent(spaces) if env_id == "CartPole-v1" else GaussianPgAgent(spaces)
        if isinstance(agent, GaussianPgAgent):
            with torch.no_grad():
                agent.model.log_std.fill_(-0.3)  # type: ignore[operator]
        batch = _random_batch(agent, 32, 8, seed=1)
        initial = {k: v.clone() for k, v in agent.model.state_dict().items()}
        assert fused_update_supported(agent)
        if not fused:
            monkeypatch.setattr("rlplex.algos.ppo.fused_update_supported", lambda agent: False)
        algo = PPO(config)
        algo.initialize(agent, n_itr=10)
        assert (algo._flat is not None) == fused
        torch.manual_seed(2)  # the same minibatch order for both
        info = algo.optimize_agent(0, batch)
        results.append((info, {k: v.clone() for k, v in agent.model.state_dict().items()}))
        moved = max(float((v - initial[k]).abs().max()) for k, v in results[-1][1].items())
        assert moved > 1e-3, "the update should move the weights by far more than the tolerance"
    (fused_info, fused_state), (auto_info, auto_state) = results
    assert fused_info["losses/clipfrac"] > 0, "the batch should exercise the clipped branch"
    for key, value in fused_state.items():
        np.testing.assert_allclose(value, auto_state[key], rtol=0, atol=2e-6, err_msg=key)
    for key, value in fused_info.items():
        assert value == pytest.approx(auto_info[key], abs=1e-5), key


def test_a_wrapped_or_custom_model_takes_the_autograd_path() -> None:
    agent = CategoricalPgAgent(probe_spaces(EnvConfig(id="CartPole-v1")))
    assert fused_update_supported(agent)

    class Custom(ActorCriticMlp):
        pass

    agent.model = Custom(4, 2)
    assert not fused_update_supported(agent)


def test_categorical_agent_samples_actions_with_the_policy_probabilities() -> None:
    agent = CategoricalPgAgent(probe_spaces(EnvConfig(id="CartPole-v1")))
    probs = torch.tensor([0.2, 0.5, 0.3])
    logits = probs.log().expand(20_000, 3)
    torch.manual_seed(0)
    action, log_prob = agent._sample(logits)
    frequencies = torch.bincount(action, minlength=3).float() / len(action)
    np.testing.assert_allclose(frequencies, probs, atol=0.01)  # 3+ standard errors
    np.testing.assert_allclose(log_prob, probs.log()[action], rtol=1e-6)
    # A total probability that rounds below the draw still gives a valid action.
    edge = torch.tensor([[0.0, -30.0]])
    assert all(int(agent._sample(edge)[0]) in (0, 1) for _ in range(100))


def test_ppo_refuses_to_train_a_stale_copy_of_replaced_parameters() -> None:
    agent = CategoricalPgAgent(probe_spaces(EnvConfig(id="CartPole-v1")))
    batch = _random_batch(agent, 8, 4, seed=0)
    algo = PPO(PPOConfig(n_epochs=1, minibatch_size=32))
    algo.initialize(agent, n_itr=10)
    before = agent.model.pi[0].weight.detach().clone()
    algo.optimize_agent(0, batch)
    assert not torch.equal(agent.model.pi[0].weight, before), "the module's own parameters are trained"
    agent.model.load_state_dict({k: v.clone() for k, v in agent.model.state_dict().items()}, assign=True)
    with pytest.raises(RlplexError, match=r"replaced after PPO\.initialize"):
        algo.optimize_agent(1, batch)
    algo.initialize(agent, n_itr=10)
    algo.optimize_agent(1, batch)
