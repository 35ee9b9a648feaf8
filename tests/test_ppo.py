from __future__ import annotations

import numpy as np
import pytest
import torch

from rlplex.agents.pg import CategoricalPgAgent, GaussianPgAgent, PgAgent
from rlplex.algos.pg_batch import clip_grad_norm
from rlplex.algos.ppo import PPO, PPOConfig
from rlplex.algos.rl_math import clipped_surrogate
from rlplex.envs import EnvConfig, probe_spaces
from rlplex.errors import RlplexError
from rlplex.models import ActorCriticMlp, QMlp
from rlplex.samplers.batch import SampleBatch, allocate_batch


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


def _reference_gradients(
    agent: PgAgent, mb: dict[str, torch.Tensor], clip: float, cfg: PPOConfig
) -> list[torch.Tensor]:
    """PPO's loss written with torch.distributions on freshly built nn.Sequential copies of the
    agent's layers, differentiated by plain autograd: none of rlplex's own code."""
    model = agent.model
    pi, v = (
        torch.nn.Sequential(*(type(layer)(*_layer_args(layer)) for layer in stack)) for stack in (model.pi, model.v)
    )
    pi.load_state_dict(model.pi.state_dict())
    v.load_state_dict(model.v.state_dict())
    log_std = model.log_std.detach().clone().requires_grad_(True) if isinstance(agent, GaussianPgAgent) else None
    out, value = pi(mb["obs"]), v(mb["obs"]).squeeze(-1)
    if log_std is None:
        dist = torch.distributions.Categorical(logits=out)
        log_prob, entropy = dist.log_prob(mb["action"]), dist.entropy()
    else:
        normal = torch.distributions.Normal(out, log_std.exp())
        log_prob, entropy = normal.log_prob(mb["action"]).sum(-1), normal.entropy().sum(-1)
    ratio = torch.exp(log_prob - mb["old_log_prob"])
    adv = mb["adv"]
    policy_loss = -torch.min(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv).mean()
    value_loss = 0.5 * ((value - mb["ret"]) ** 2).mean()
    loss = policy_loss + cfg.value_coef * value_loss - cfg.entropy_coef * entropy.mean()
    leaves = [*pi.parameters(), *v.parameters(), *([log_std] if log_std is not None else [])]
    return list(torch.autograd.grad(loss, leaves))


def _layer_args(layer: torch.nn.Module) -> tuple[int, ...]:
    return (layer.in_features, layer.out_features) if isinstance(layer, torch.nn.Linear) else ()


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_ppo_gradients_equal_plain_autograd_on_independent_layers(env_id: str) -> None:
    """PPO's minibatch loss as `PPO.optimize_agent` builds it (the agent's `evaluate_batch`,
    `rl_math.clipped_surrogate`) against the same loss written with torch.distributions."""
    spaces = probe_spaces(EnvConfig(id=env_id))
    torch.manual_seed(0)
    agent: PgAgent = CategoricalPgAgent(spaces) if env_id == "CartPole-v1" else GaussianPgAgent(spaces)
    if isinstance(agent, GaussianPgAgent):
        with torch.no_grad():
            agent.model.log_std.fill_(-0.3)  # type: ignore[operator]
    batch = _random_batch(agent, 16, 8, seed=1)
    n = 16 * 8
    mb = {
        "obs": torch.as_tensor(batch.observation.reshape(n, -1)),
        "action": torch.as_tensor(batch.action.reshape(n, *batch.action.shape[2:])),
        "old_log_prob": torch.as_tensor(batch.agent_info["log_prob"].reshape(n)),
        "adv": torch.as_tensor(batch.reward.reshape(n)),
        "ret": torch.as_tensor(np.random.default_rng(3).normal(size=n).astype(np.float32)),
    }
    cfg = PPOConfig(value_coef=0.7, entropy_coef=0.05)
    clip = 0.2
    log_prob, entropy, value = agent.evaluate_batch({"observation": mb["obs"], "action": mb["action"]})
    surrogate = clipped_surrogate(log_prob, mb["old_log_prob"], mb["adv"], clip)
    value_loss = 0.5 * (value - mb["ret"]).pow(2).mean()
    (surrogate.loss.mean() + cfg.value_coef * value_loss - cfg.entropy_coef * entropy.mean()).backward()
    assert 0 < float(((surrogate.ratio - 1).abs() > clip).float().mean()) < 1, "both branches of the clip"
    model = agent.model
    ours = [*(p.grad for p in model.pi.parameters()), *(p.grad for p in model.v.parameters())]
    if isinstance(agent, GaussianPgAgent):
        ours.append(model.log_std.grad)
    reference = _reference_gradients(agent, mb, clip, cfg)
    assert len(ours) == len(reference)
    for mine, theirs in zip(ours, reference, strict=True):
        assert mine is not None and float(theirs.abs().max()) > 0
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(("layer", "name"), [(torch.nn.ReLU(), "ReLU"), (torch.nn.LayerNorm(64), "LayerNorm")])
def test_ppo_trains_any_layer_of_the_policy(layer: torch.nn.Module, name: str) -> None:
    spaces = probe_spaces(EnvConfig(id="CartPole-v1"))
    agent = CategoricalPgAgent(spaces)
    agent.model.pi[1] = layer
    algo = PPO(PPOConfig(n_epochs=1, minibatch_size=32))
    algo.initialize(agent, n_itr=10)
    before = agent.model.pi[0].weight.detach().clone()
    assert np.isfinite(algo.optimize_agent(0, _random_batch(agent, 8, 4, seed=0))["losses/policy"]), name
    assert not torch.equal(agent.model.pi[0].weight, before)


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
