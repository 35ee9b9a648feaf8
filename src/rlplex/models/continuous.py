"""Actors and critics for continuous actions (SAC, TD3, DDPG).

Actors work in the normalised action space [-1, 1] (tanh outputs) and carry the affine map
to the environment's bounds as buffers, so a sampler process that receives the weights
receives the bounds too. The same goes for the acting switches (`random_actions` before
learning starts, the TD3/DDPG `exploration_noise`): buffers, not agent attributes.

Critics are an ensemble of Q(s, a) MLPs whose weights are stacked on a leading axis, so
twin critics cost one batched matmul per layer rather than one module call per critic.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import nn

from rlplex.models.mlp import mlp, run_mlp

LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0  # SB3's clamp for SAC's state-dependent log std


class BoundedActor(nn.Module):
    """Buffers shared by both actors: action bounds and the random-actions switch."""

    action_scale: torch.Tensor
    action_bias: torch.Tensor
    random_actions: torch.Tensor

    def __init__(self, low: Sequence[float], high: Sequence[float]) -> None:
        super().__init__()
        low_t, high_t = torch.tensor(low, dtype=torch.float32), torch.tensor(high, dtype=torch.float32)
        self.register_buffer("action_scale", (high_t - low_t) / 2)
        self.register_buffer("action_bias", (high_t + low_t) / 2)
        # 1.0 while the replay is filling: act uniformly at random (SB3's learning_starts).
        self.register_buffer("random_actions", torch.tensor(1.0))

    @property
    def action_dim(self) -> int:
        return int(self.action_scale.shape[0])

    def to_env(self, normalized: torch.Tensor) -> torch.Tensor:
        return normalized * self.action_scale + self.action_bias

    def to_normalized(self, action: torch.Tensor) -> torch.Tensor:
        return (action - self.action_bias) / self.action_scale


class SquashedGaussianActor(BoundedActor):
    """SAC's policy: one MLP gives the Gaussian's mean and log std; actions are tanh(sample)."""

    def __init__(
        self, obs_dim: int, action_dim: int, low: Sequence[float], high: Sequence[float], hidden: Sequence[int]
    ) -> None:
        super().__init__(low, high)
        self.net = mlp(obs_dim, hidden, 2 * action_dim, activation=nn.ReLU)

    def forward(self, obs_B_O: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean_B_A, log_std_B_A = run_mlp(self.net, obs_B_O).chunk(2, dim=-1)
        return mean_B_A, log_std_B_A.clamp(LOG_STD_MIN, LOG_STD_MAX)

    def sample(
        self, obs_B_O: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised action, its log-probability), reparameterised: differentiable in the weights.

        The log-probability is of the action in [-1, 1], as in SB3, so the target entropy
        -dim(A) does not depend on the environment's bounds.
        """
        mean, log_std = self(obs_B_O)
        noise = torch.randn(mean.shape, generator=generator, device=mean.device)
        u = mean + noise * log_std.exp()
        # log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u)), without tanh's saturation at 1.
        log_det = 2.0 * (math.log(2.0) - u - nn.functional.softplus(-2.0 * u))
        log_prob = (-0.5 * noise.pow(2) - log_std - 0.5 * math.log(2 * math.pi) - log_det).sum(-1)
        return torch.tanh(u), log_prob

    def mode(self, obs_B_O: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self(obs_B_O)[0])


class DeterministicActor(BoundedActor):
    """TD3/DDPG's policy: a tanh MLP; `exploration_noise` is the std of the Gaussian noise
    added when acting, in normalised units (SB3's NormalActionNoise on the scaled action)."""

    exploration_noise: torch.Tensor

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        low: Sequence[float],
        high: Sequence[float],
        hidden: Sequence[int],
        exploration_noise: float = 0.1,
    ) -> None:
        super().__init__(low, high)
        self.net = mlp(obs_dim, hidden, action_dim, activation=nn.ReLU)
        self.register_buffer("exploration_noise", torch.tensor(float(exploration_noise)))

    def forward(self, obs_B_O: torch.Tensor) -> torch.Tensor:
        return torch.tanh(run_mlp(self.net, obs_B_O))


class QEnsemble(nn.Module):
    """`n` independent Q(s, a) MLPs (ReLU) evaluated together: forward returns q_N_B.

    Initialised as `nn.Linear` is (uniform in +-1/sqrt(fan_in) for weights and biases), from
    `generator` when given, so that an algorithm's critics depend on its seed alone.
    """

    def __init__(
        self, obs_dim: int, action_dim: int, hidden: Sequence[int], n: int = 2, generator: torch.Generator | None = None
    ) -> None:
        super().__init__()
        sizes = [obs_dim + action_dim, *hidden, 1]
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for fan_in, fan_out in itertools.pairwise(sizes):
            bound = 1.0 / math.sqrt(fan_in)
            for shape, params in (((n, fan_in, fan_out), self.weights), ((n, 1, fan_out), self.biases)):
                params.append(nn.Parameter(torch.empty(shape).uniform_(-bound, bound, generator=generator)))
        self.n = n

    def forward(self, obs_B_O: torch.Tensor, action_B_A: torch.Tensor, first: int | None = None) -> torch.Tensor:
        """Q-values of every member, or of the `first` ones only (TD3's actor needs Q_1 alone)."""
        n = self.n if first is None else first
        h = torch.cat((obs_B_O, action_B_A), dim=-1).expand(n, -1, -1)
        last = len(self.weights) - 1
        for i, (weight, bias) in enumerate(zip(self.weights, self.biases, strict=True)):
            # Sliced only when asked: a slice's backward zero-fills and copies the whole stack.
            if n != self.n:
                weight, bias = weight[:n], bias[:n]
            h = torch.baddbmm(bias, h, weight)
            if i < last:
                h = torch.relu(h)
        return h.squeeze(-1)
