"""Small MLPs for classic-control agents.

Every piece of agent state that a sampler needs (weights, and scalars such as DQN's
epsilon) lives in the module's `state_dict`, as a parameter or a buffer, so that one weight
copy brings a remote sampler fully up to date.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable


def mlp(in_dim: int, hidden: Sequence[int], out_dim: int, activation: type[nn.Module] = nn.Tanh) -> nn.Sequential:
    layers: list[nn.Module] = []
    last = in_dim
    for width in hidden:
        layers += [nn.Linear(last, width), activation()]
        last = width
    layers.append(nn.Linear(last, out_dim))
    return nn.Sequential(*layers)


_ACTIVATIONS: dict[type[nn.Module], str] = {nn.Tanh: "tanh", nn.ReLU: "relu"}


def mlp_forward(
    x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor], activation: str
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(output, the input of every layer) of a Linear/activation stack, without autograd."""
    act = torch.tanh if activation == "tanh" else torch.relu
    layer_inputs = [x]
    h = x
    for i, (weight, bias) in enumerate(zip(weights, biases, strict=True)):
        h = torch.addmm(bias, h, weight.t())
        if i < len(weights) - 1:
            h = act(h)
            layer_inputs.append(h)
    return h, layer_inputs


def mlp_backward(
    grad_out: torch.Tensor,
    layer_inputs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    activation: str,
    input_grad: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
    """(weight grads, bias grads, the input's grad if asked) for `mlp_forward`.

    The same ops autograd runs for addmm and tanh/relu, so the same gradients.
    """
    weight_grads: list[torch.Tensor] = [grad_out] * len(weights)
    bias_grads: list[torch.Tensor] = [grad_out] * len(weights)
    grad = grad_out
    grad_x: torch.Tensor | None = None
    for i in range(len(weights) - 1, -1, -1):
        weight_grads[i] = grad.t().mm(layer_inputs[i])
        bias_grads[i] = grad.sum(0)
        if i > 0:
            below = layer_inputs[i]  # the activation's output
            grad = grad.mm(weights[i])
            if activation == "tanh":
                grad = torch.ops.aten.tanh_backward(grad, below)
            else:
                grad = torch.ops.aten.threshold_backward(grad, below, 0)
        elif input_grad:
            grad_x = grad.mm(weights[0])
    return weight_grads, bias_grads, grad_x


class _MlpFunction(torch.autograd.Function):
    """A Linear/activation stack as ONE autograd node, with its backward written out.

    Autograd records a node per op and walks them one by one; for a 64-wide MLP on a batch
    of a few hundred that bookkeeping costs about as much as the arithmetic. Inputs: x, the
    activation's name, then every layer's weight, then every layer's bias.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, activation: str, *weights_biases: torch.Tensor) -> torch.Tensor:
        n_layers = len(weights_biases) // 2
        weights = weights_biases[:n_layers]
        out, layer_inputs = mlp_forward(x, weights, weights_biases[n_layers:], activation)
        ctx.activation = activation
        ctx.save_for_backward(*layer_inputs, *weights)
        return out

    @staticmethod
    @once_differentiable  # a second derivative through the written-out backward is not supported
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        n_layers = len(saved) // 2
        weight_grads, bias_grads, grad_x = mlp_backward(
            grad_out, saved[:n_layers], saved[n_layers:], ctx.activation, bool(ctx.needs_input_grad[0])
        )
        return (grad_x, None, *weight_grads, *bias_grads)


def _fusable(layers: nn.Sequential, x: torch.Tensor) -> str | None:
    """The activation name when `layers` is Linear (act Linear)* with one activation type and
    `x` a 2-D batch; None otherwise."""
    if x.dim() != 2 or len(layers) % 2 == 0:
        return None
    activation: str | None = None
    for i, layer in enumerate(layers):
        if i % 2 == 0:
            if type(layer) is not nn.Linear or layer.bias is None:
                return None
        else:
            name = _ACTIVATIONS.get(type(layer))
            if name is None or activation not in (None, name):
                return None
            activation = name
    return activation or "tanh"


def run_mlp(layers: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """`layers(x)`, without the per-module and per-op overheads that dominate small MLPs.

    With gradients wanted, a plain Linear/Tanh (or Linear/ReLU) stack runs as one autograd
    node (`_MlpFunction`); otherwise the functional ops of Linear, Tanh and ReLU are called
    directly (a module call costs several microseconds of hook bookkeeping, about as much as
    a small layer's arithmetic). Other layer types are called normally.
    """
    if torch.is_grad_enabled():
        activation = _fusable(layers, x)
        if activation is not None:
            weights, biases = _weights_biases(layers)
            out = _MlpFunction.apply(x, activation, *weights, *biases)
            assert isinstance(out, torch.Tensor)
            return out
    for layer in layers:
        if type(layer) is nn.Linear:
            x = F.linear(x, layer.weight, layer.bias)
        elif type(layer) is nn.Tanh:
            x = torch.tanh(x)
        elif type(layer) is nn.ReLU:
            x = torch.relu(x)
        else:
            x = layer(x)
    return x


ActorCriticSaved = tuple[list[torch.Tensor], list[torch.Tensor]]
"""Each layer's input in the policy and the value MLP, from `ActorCriticMlp.forward_saving`."""


def _linears(layers: nn.Sequential) -> list[nn.Linear]:
    # Not layers[0::2]: slicing a Sequential builds a new Module, tens of µs per call.
    return [layer for layer in layers if type(layer) is nn.Linear]


def _weights_biases(layers: nn.Sequential) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    linears = _linears(layers)
    return [m.weight for m in linears], [m.bias for m in linears]


def _init_orthogonal(module: nn.Sequential, last_gain: float) -> None:
    linears = _linears(module)
    for i, layer in enumerate(linears):
        nn.init.orthogonal_(layer.weight, gain=last_gain if i == len(linears) - 1 else float(np.sqrt(2)))
        nn.init.zeros_(layer.bias)


class ActorCriticMlp(nn.Module):
    """Separate policy and value MLPs; forward returns (logits_B_A, value_B)."""

    def __init__(self, obs_dim: int, n_outputs: int, hidden: Sequence[int] = (64, 64)) -> None:
        super().__init__()
        self.pi = mlp(obs_dim, hidden, n_outputs)
        self.v = mlp(obs_dim, hidden, 1)
        _init_orthogonal(self.pi, 0.01)
        _init_orthogonal(self.v, 1.0)

    def forward(self, obs_B_O: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return run_mlp(self.pi, obs_B_O), run_mlp(self.v, obs_B_O).squeeze(-1)

    def forward_saving(self, obs_B_O: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, ActorCriticSaved]:
        """`forward` without autograd, keeping what `backward_into_grads` needs."""
        out, pi_inputs = mlp_forward(obs_B_O, *_weights_biases(self.pi), "tanh")
        value, v_inputs = mlp_forward(obs_B_O, *_weights_biases(self.v), "tanh")
        return out, value.squeeze(-1), (pi_inputs, v_inputs)

    def backward_into_grads(self, saved: ActorCriticSaved, grad_out: torch.Tensor, grad_value: torch.Tensor) -> None:
        """Sets `.grad` of the pi and v layers from the gradients of `forward_saving`'s outputs."""
        for layers, layer_inputs, grad in ((self.pi, saved[0], grad_out), (self.v, saved[1], grad_value.unsqueeze(-1))):
            linears = _linears(layers)
            weight_grads, bias_grads, _ = mlp_backward(grad, layer_inputs, [m.weight for m in linears], "tanh")
            for layer, weight_grad, bias_grad in zip(linears, weight_grads, bias_grads, strict=True):
                layer.weight.grad, layer.bias.grad = weight_grad, bias_grad


class GaussianActorCriticMlp(ActorCriticMlp):
    """Gaussian policy with a state-independent log std; forward returns (mean_B_A, value_B)."""

    def __init__(
        self, obs_dim: int, action_dim: int, hidden: Sequence[int] = (64, 64), init_log_std: float = 0.0
    ) -> None:
        super().__init__(obs_dim, action_dim, hidden)
        self.log_std = nn.Parameter(torch.full((action_dim,), float(init_log_std)))


class QMlp(nn.Module):
    """Q-values per action; `epsilon` is a buffer so that samplers receive it with the weights.

    `dueling`: a value and an advantage head over a shared trunk, Q = V + A - mean_a A (one
    Linear computes both heads). `n_atoms` > 1: categorical (C51) outputs, logits [B, A,
    n_atoms] over the fixed `support` (a buffer from v_min to v_max); a dueling C51 combines
    the logits the same way. Otherwise the output is Q [B, A].
    """

    def __init__(
        self,
        obs_dim: int,
        n_actions: int,
        hidden: Sequence[int] = (64, 64),
        dueling: bool = False,
        n_atoms: int = 1,
        v_min: float = -10.0,
        v_max: float = 10.0,
    ) -> None:
        super().__init__()
        self.n_actions, self.n_atoms, self.dueling = n_actions, n_atoms, dueling
        if dueling:
            if not hidden:
                raise ValueError("a dueling Q-network needs at least one hidden layer")
            # The trunk ends in a Linear; its ReLU is applied in forward before the heads.
            self.trunk = mlp(obs_dim, hidden[:-1], hidden[-1], activation=nn.ReLU)
            self.head = nn.Linear(hidden[-1], (1 + n_actions) * n_atoms)
        else:
            self.q = mlp(obs_dim, hidden, n_actions * n_atoms, activation=nn.ReLU)
        self.register_buffer("epsilon", torch.tensor(1.0))
        if n_atoms > 1:
            self.register_buffer("support", torch.linspace(v_min, v_max, n_atoms))

    def forward(self, obs_B_O: torch.Tensor) -> torch.Tensor:
        if not self.dueling:
            out = run_mlp(self.q, obs_B_O)
            return out if self.n_atoms == 1 else out.view(-1, self.n_actions, self.n_atoms)
        heads = F.linear(torch.relu(run_mlp(self.trunk, obs_B_O)), self.head.weight, self.head.bias)
        heads = heads.view(-1, 1 + self.n_actions, self.n_atoms)
        value, advantage = heads[:, :1], heads[:, 1:]
        out = value + advantage - advantage.mean(dim=1, keepdim=True)
        return out.squeeze(-1) if self.n_atoms == 1 else out

    def q_values(self, out: torch.Tensor) -> torch.Tensor:
        """Q [B, A] from `forward`'s output (the expectation over the support for C51)."""
        if self.n_atoms == 1:
            return out
        support = self.support
        assert isinstance(support, torch.Tensor)
        return (torch.softmax(out, dim=-1) * support).sum(dim=-1)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside a DistributedDataParallel wrapper (itself otherwise)."""
    inner = getattr(model, "module", model)
    return inner if isinstance(inner, nn.Module) else model
