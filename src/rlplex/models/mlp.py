"""Small MLPs for classic-control agents, optionally behind an observation encoder.

An `encoder` (`rlplex.models.encoders`: the Nature CNN for images, a flattening for other
Boxes) turns observations into features first; the heads are then the MLPs below with
`obs_dim` = the encoder's width. Actor-critics share one encoder between policy and value.

Every piece of agent state that a sampler needs (weights, and scalars such as DQN's
epsilon) lives in the module's `state_dict`, as a parameter or a buffer, so that one weight
copy brings a remote sampler fully up to date.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def mlp(in_dim: int, hidden: Sequence[int], out_dim: int, activation: type[nn.Module] = nn.Tanh) -> nn.Sequential:
    layers: list[nn.Module] = []
    last = in_dim
    for width in hidden:
        layers += [nn.Linear(last, width), activation()]
        last = width
    layers.append(nn.Linear(last, out_dim))
    return nn.Sequential(*layers)


def run_mlp(layers: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """`layers(x)`, calling the functional ops of Linear, Tanh and ReLU directly: a module call
    costs several microseconds of hook bookkeeping, about as much as a small layer's
    arithmetic. Other layer types are called normally. Autograd records the same ops."""
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


def _linears(layers: nn.Sequential) -> list[nn.Linear]:
    # Not layers[0::2]: slicing a Sequential builds a new Module, tens of µs per call.
    return [layer for layer in layers if type(layer) is nn.Linear]


def _init_orthogonal(module: nn.Sequential, last_gain: float) -> None:
    linears = _linears(module)
    for i, layer in enumerate(linears):
        nn.init.orthogonal_(layer.weight, gain=last_gain if i == len(linears) - 1 else float(np.sqrt(2)))
        nn.init.zeros_(layer.bias)


class ActorCriticMlp(nn.Module):
    """Separate policy and value MLPs; forward returns (logits_B_A, value_B)."""

    def __init__(
        self, obs_dim: int, n_outputs: int, hidden: Sequence[int] = (64, 64), encoder: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.encoder = encoder
        self.pi = mlp(obs_dim, hidden, n_outputs)
        self.v = mlp(obs_dim, hidden, 1)
        _init_orthogonal(self.pi, 0.01)
        _init_orthogonal(self.v, 1.0)

    def forward(self, obs_B_O: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = obs_B_O if self.encoder is None else self.encoder(obs_B_O)
        return run_mlp(self.pi, x), run_mlp(self.v, x).squeeze(-1)


class GaussianActorCriticMlp(ActorCriticMlp):
    """Gaussian policy with a state-independent log std; forward returns (mean_B_A, value_B)."""

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        hidden: Sequence[int] = (64, 64),
        init_log_std: float = 0.0,
        encoder: nn.Module | None = None,
    ) -> None:
        super().__init__(obs_dim, action_dim, hidden, encoder)
        self.log_std = nn.Parameter(torch.full((action_dim,), float(init_log_std)))


class QMlp(nn.Module):
    """Q-values per action; `epsilon` is a buffer so that samplers receive it with the weights.

    `dueling`: a value and an advantage head over a shared trunk, Q = V + A - mean_a A (one
    Linear computes both heads). `n_atoms` > 1: categorical (C51) outputs, logits [B, A,
    n_atoms] over the fixed `support` (a buffer from v_min to v_max); a dueling C51 combines
    the logits the same way. Otherwise the output is Q [B, A]. With an `encoder` and no
    hidden layers, a dueling network's heads read the encoder's features directly.
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
        encoder: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.n_actions, self.n_atoms, self.dueling = n_actions, n_atoms, dueling
        self.encoder = encoder
        if dueling:
            if not hidden and encoder is None:
                raise ValueError("a dueling Q-network needs at least one hidden layer")
            # The trunk ends in a Linear; its ReLU is applied in forward before the heads.
            self.trunk = mlp(obs_dim, hidden[:-1], hidden[-1], activation=nn.ReLU) if hidden else None
            self.head = nn.Linear(hidden[-1] if hidden else obs_dim, (1 + n_actions) * n_atoms)
        else:
            self.q = mlp(obs_dim, hidden, n_actions * n_atoms, activation=nn.ReLU)
        self.register_buffer("epsilon", torch.tensor(1.0))
        if n_atoms > 1:
            self.register_buffer("support", torch.linspace(v_min, v_max, n_atoms))

    def forward(self, obs_B_O: torch.Tensor) -> torch.Tensor:
        x = obs_B_O if self.encoder is None else self.encoder(obs_B_O)
        if not self.dueling:
            out = run_mlp(self.q, x)
            return out if self.n_atoms == 1 else out.view(-1, self.n_actions, self.n_atoms)
        features = x if self.trunk is None else torch.relu(run_mlp(self.trunk, x))
        heads = F.linear(features, self.head.weight, self.head.bias)
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
