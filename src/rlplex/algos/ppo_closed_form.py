"""PPO's gradients in closed form, without autograd: `PPOConfig.closed_form_gradients`, off by default.

For a CartPole-sized tanh MLP, autograd's per-op bookkeeping costs about as much as the
arithmetic; writing the backward out halves PPO's update time (see `benchmarks.ppo_vs_sb3`).
It is worth it only there, so it is confined to this module and to models it can prove it
handles: rlplex's own categorical or Gaussian agent, unwrapped (a DDP-wrapped model needs
autograd's hooks), whose policy and value networks are each an `nn.Sequential` of
`Linear (Tanh Linear)*` with biases, every parameter trained. Anything else is refused with
a `ConfigError` naming the layer; leave the switch off for it and autograd trains it.

The arithmetic is autograd's for the same expressions (the min's and the clamp's masks,
tanh_backward, addmm's transposes), so the two agree to float rounding; `tests/test_ppo.py`
checks that against plain autograd on independently built layers.
"""

from __future__ import annotations

import torch
from torch import nn

from rlplex.agents.pg import CategoricalPgAgent, GaussianPgAgent, PgAgent
from rlplex.algos.rl_math import Surrogate, clipped_surrogate
from rlplex.errors import ConfigError
from rlplex.models import ActorCriticMlp, GaussianActorCriticMlp


def _tanh_linears(layers: object, where: str) -> list[nn.Linear]:
    """The Linear layers of a `Linear (Tanh Linear)*` stack; ConfigError naming anything else."""
    if not isinstance(layers, nn.Sequential) or len(layers) % 2 == 0:
        raise ConfigError(f"closed_form_gradients: {where} must be an nn.Sequential of Linear (Tanh Linear)*")
    for i, layer in enumerate(layers):
        wanted = nn.Linear if i % 2 == 0 else nn.Tanh
        if type(layer) is not wanted or (wanted is nn.Linear and layer.bias is None):
            raise ConfigError(
                f"closed_form_gradients: {where}[{i}] is {type(layer).__name__}, but the written-out backward "
                f"handles only Linear (with bias) and Tanh layers; set closed_form_gradients = false for this model"
            )
    return [layer for layer in layers if isinstance(layer, nn.Linear)]


def check_supported(agent: PgAgent) -> tuple[list[nn.Linear], list[nn.Linear]]:
    """(the policy's Linear layers, the value's), or ConfigError saying what the closed form cannot handle."""
    if type(agent) not in (CategoricalPgAgent, GaussianPgAgent):
        raise ConfigError(f"closed_form_gradients: needs rlplex's own PG agents, got {type(agent).__name__}")
    model = agent.model
    if type(model) not in (ActorCriticMlp, GaussianActorCriticMlp):
        raise ConfigError(
            f"closed_form_gradients: needs an unwrapped ActorCriticMlp, got {type(model).__name__} "
            "(a DDP-wrapped or custom model trains with autograd: set closed_form_gradients = false)"
        )
    if not all(p.requires_grad for p in model.parameters()):
        raise ConfigError("closed_form_gradients: every parameter of the model must be trained")
    if model.encoder is not None:
        raise ConfigError(
            f"closed_form_gradients: covers MLPs on 1-D float observations only; this agent reads them through a "
            f"{type(model.encoder).__name__} encoder (set closed_form_gradients = false)"
        )
    return _tanh_linears(model.pi, "model.pi"), _tanh_linears(model.v, "model.v")


def _forward(x: torch.Tensor, linears: list[nn.Linear]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(output, each layer's input) of a Linear/Tanh stack."""
    inputs = [x]
    h = x
    for i, layer in enumerate(linears):
        h = torch.addmm(layer.bias, h, layer.weight.t())
        if i < len(linears) - 1:
            h = torch.tanh(h)
            inputs.append(h)
    return h, inputs


def _backward_into_grads(grad: torch.Tensor, inputs: list[torch.Tensor], linears: list[nn.Linear]) -> None:
    """Sets each layer's weight and bias `.grad` from the gradient of `_forward`'s output."""
    for i in range(len(linears) - 1, -1, -1):
        layer = linears[i]
        layer.weight.grad = grad.t().mm(inputs[i])
        layer.bias.grad = grad.sum(0)
        if i > 0:
            grad = torch.ops.aten.tanh_backward(grad.mm(layer.weight), inputs[i])


def _categorical_backward(
    logits: torch.Tensor, action: torch.Tensor, grad_log_prob: torch.Tensor, entropy_weight: float
) -> torch.Tensor:
    """d loss / d logits for loss = f(log_prob) - entropy_weight * sum(entropy), given d f / d log_prob."""
    # d log p_a / d logits = onehot(a) - p;  d H / d logits = -p * (log p + H)
    log_p = torch.log_softmax(logits, dim=-1)
    p = log_p.exp()
    grad = torch.zeros_like(logits).scatter_(-1, action.long().unsqueeze(-1), grad_log_prob.unsqueeze(-1))
    grad.sub_(p * grad_log_prob.unsqueeze(-1))
    if entropy_weight != 0.0:
        entropy = -(p * log_p).sum(-1, keepdim=True)
        grad.add_(p * (log_p + entropy), alpha=entropy_weight)
    return grad


def _gaussian_backward(
    log_std: torch.Tensor, mean: torch.Tensor, action: torch.Tensor, grad_log_prob: torch.Tensor, entropy_weight: float
) -> torch.Tensor:
    """d loss / d mean, as `_categorical_backward`; sets `log_std.grad`."""
    # z = (a - mean) / std:  d log p / d mean = z / std;  d log p / d log_std = z^2 - 1;
    # d H / d log_std = 1 per sample.
    inv_std = (-log_std).exp()
    z = (action - mean) * inv_std
    grad_log_prob = grad_log_prob.unsqueeze(-1)
    log_std_grad = (grad_log_prob * (z * z - 1.0)).sum(0)
    if entropy_weight != 0.0:
        log_std_grad.sub_(entropy_weight * mean.shape[0])
    log_std.grad = log_std_grad.reshape(log_std.shape)
    return grad_log_prob * z * inv_std


class ClosedFormGradients:
    """Sets `.grad` of every parameter of the agent's model to that of PPO's loss
    mean(surrogate) + value_coef * 0.5 mean((v - returns)^2) - entropy_coef * mean(entropy).
    Built once per agent (`check_supported` then refuses what it cannot handle)."""

    def __init__(self, agent: PgAgent) -> None:
        self.agent = agent
        self.pi, self.v = check_supported(agent)

    @torch.no_grad()
    def __call__(
        self,
        observation: torch.Tensor,
        action: torch.Tensor,
        old_log_prob: torch.Tensor,
        advantage: torch.Tensor,
        returns: torch.Tensor,
        clip: float,
        value_coef: float,
        entropy_coef: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Surrogate]:
        """(policy loss, value loss, mean entropy, the surrogate), as autograd's path returns them."""
        agent, n = self.agent, observation.shape[0]
        out, pi_inputs = _forward(observation, self.pi)
        value, v_inputs = _forward(observation, self.v)
        value = value.squeeze(-1)
        log_prob, entropy = agent.log_prob_entropy(out, action)
        surrogate = clipped_surrogate(log_prob, old_log_prob, advantage, clip)
        # d mean(-min(r A, clip(r) A)) / d log_prob = -r A / n where the unclipped term is the min, else 0.
        unclipped = surrogate.ratio * advantage
        grad_log_prob = torch.where(unclipped <= surrogate.ratio.clamp(1 - clip, 1 + clip) * advantage, unclipped, 0.0)
        grad_log_prob.mul_(-1.0 / n)
        value_error = value - returns
        value_loss = 0.5 * value_error.pow(2).mean()
        entropy_weight = entropy_coef / n
        if isinstance(agent, CategoricalPgAgent):
            grad_out = _categorical_backward(out, action, grad_log_prob, entropy_weight)
        else:
            log_std = agent.model.log_std
            assert isinstance(log_std, torch.Tensor)
            grad_out = _gaussian_backward(log_std, out, action, grad_log_prob, entropy_weight)
        _backward_into_grads(grad_out, pi_inputs, self.pi)
        _backward_into_grads(value_error.mul_(value_coef / n).unsqueeze(-1), v_inputs, self.v)
        return surrogate.loss.mean(), value_loss, entropy.mean(), surrogate
