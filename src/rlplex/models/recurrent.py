"""The LSTM trunk every recurrent agent uses, and the two heads over it (actor-critic, Q).

Shapes are time-major: observations [T, B, O], the recurrent state a pair (h, c) of
[B, H]. Acting is a sequence of length 1. `reset_T_B` marks the steps before which an
environment's state restarts at zero (its previous step ended an episode), so a [T, B]
sequence that crosses episode ends is replayed exactly as the sampler ran it. Where no
environment resets, the whole sequence is one `nn.LSTM` call; otherwise one call per stretch
between resets (a Python loop over steps only where every step resets something).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rlplex.models.mlp import run_mlp

State = tuple[torch.Tensor, torch.Tensor]  # (h, c), each [B, H]


def _layered(h: torch.Tensor, c: torch.Tensor) -> State:
    """(h, c) as the one-layer [1, B, H] state `nn.LSTM` takes. Contiguous: cuDNN refuses the
    strided halves that `RecurrentActorCritic.split` cuts from the joint state."""
    return h.unsqueeze(0).contiguous(), c.unsqueeze(0).contiguous()


class LstmTrunk(nn.Module):
    """obs -> MLP (`hidden`, each layer followed by `activation`) -> one LSTM layer of `lstm_size`."""

    def __init__(
        self, obs_dim: int, hidden: Sequence[int], lstm_size: int, activation: type[nn.Module] = nn.Tanh
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        last = obs_dim
        for width in hidden:
            layers += [nn.Linear(last, width), activation()]
            last = width
        self.pre = nn.Sequential(*layers)
        self.lstm = nn.LSTM(last, lstm_size)
        self.lstm_size = lstm_size

    def forward(
        self, obs_T_B_O: torch.Tensor, state: State, reset_T_B: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, State]:
        """(LSTM outputs [T, B, H], the state after the last step)."""
        x = run_mlp(self.pre, obs_T_B_O)
        h, c = state
        if reset_T_B is None or not bool(reset_T_B.any()):
            out, (h1, c1) = self.lstm(x, _layered(h, c))
            return out, (h1[0], c1[0])
        T = x.shape[0]
        starts = torch.nonzero(reset_T_B.any(dim=1)).flatten().tolist()
        bounds = sorted({0, *starts, T})
        outs = []
        for start, stop in itertools.pairwise(bounds):
            keep = (~reset_T_B[start]).unsqueeze(-1).to(h.dtype)
            h, c = h * keep, c * keep
            out, (h1, c1) = self.lstm(x[start:stop], _layered(h, c))
            outs.append(out)
            h, c = h1[0], c1[0]
        return torch.cat(outs), (h, c)

    @torch.no_grad()
    def states_after_each_step(
        self, obs_T_B_O: torch.Tensor, state: State, reset_T_B: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, c) after every step, [T, B, H] each, before any reset of the next step: the state
        a step's `next_observation` is seen with. One LSTM call per step (no gradient)."""
        hs, cs = [], []
        h, c = state
        for t in range(obs_T_B_O.shape[0]):
            _, (h, c) = self.forward(obs_T_B_O[t : t + 1], (h, c), reset_T_B[t : t + 1])
            hs.append(h)
            cs.append(c)
        return torch.stack(hs), torch.stack(cs)


class RecurrentActorCritic(nn.Module):
    """Policy logits and value, each over its own `LstmTrunk` (as `ActorCriticMlp` keeps two
    MLPs: through a shared trunk the value loss's gradient, clipped together with the policy's,
    drowned the policy's and it hardly learned). The state is both trunks' side by side,
    (h, c) of [B, 2 * lstm_size]; forward returns (logits [T, B, A], value [T, B], state)."""

    def __init__(self, obs_dim: int, n_actions: int, hidden: Sequence[int] = (64,), lstm_size: int = 64) -> None:
        super().__init__()
        self.pi_trunk = LstmTrunk(obs_dim, hidden, lstm_size, nn.Tanh)
        self.v_trunk = LstmTrunk(obs_dim, hidden, lstm_size, nn.Tanh)
        self.pi = nn.Linear(lstm_size, n_actions)
        self.v = nn.Linear(lstm_size, 1)
        self.lstm_size = lstm_size
        for layer, gain in ((self.pi, 0.01), (self.v, 1.0)):
            nn.init.orthogonal_(layer.weight, gain=gain)
            nn.init.zeros_(layer.bias)
        for module in (*self.pi_trunk.pre, *self.v_trunk.pre):
            if isinstance(module, nn.Linear):
                nn.init.orthogonal_(module.weight, gain=float(np.sqrt(2)))
                nn.init.zeros_(module.bias)

    def split(self, state: State) -> tuple[State, State]:
        """(the policy trunk's state, the value trunk's) of the joint state."""
        (h_pi, h_v), (c_pi, c_v) = state[0].chunk(2, dim=-1), state[1].chunk(2, dim=-1)
        return (h_pi, c_pi), (h_v, c_v)

    def forward(
        self, obs_T_B_O: torch.Tensor, state: State, reset_T_B: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, State]:
        pi_state, v_state = self.split(state)
        pi_out, (h_pi, c_pi) = self.pi_trunk(obs_T_B_O, pi_state, reset_T_B)
        v_out, (h_v, c_v) = self.v_trunk(obs_T_B_O, v_state, reset_T_B)
        logits = F.linear(pi_out, self.pi.weight, self.pi.bias)
        return logits, self.value_head(v_out), (torch.cat((h_pi, h_v), -1), torch.cat((c_pi, c_v), -1))

    def value_head(self, v_out: torch.Tensor) -> torch.Tensor:
        return F.linear(v_out, self.v.weight, self.v.bias).squeeze(-1)


class RecurrentQNet(nn.Module):
    """Q-values [T, B, A] over one `LstmTrunk` (ReLU), optionally with a dueling head;
    `epsilon` is a buffer so that samplers receive it with the weights (as `QMlp`'s)."""

    def __init__(
        self, obs_dim: int, n_actions: int, hidden: Sequence[int] = (64,), lstm_size: int = 64, dueling: bool = True
    ) -> None:
        super().__init__()
        self.n_actions, self.dueling = n_actions, dueling
        self.trunk = LstmTrunk(obs_dim, hidden, lstm_size, nn.ReLU)
        self.head = nn.Linear(lstm_size, (1 + n_actions) if dueling else n_actions)
        self.register_buffer("epsilon", torch.tensor(1.0))

    def forward(
        self, obs_T_B_O: torch.Tensor, state: State, reset_T_B: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, State]:
        out, state = self.trunk(obs_T_B_O, state, reset_T_B)
        heads = F.linear(out, self.head.weight, self.head.bias)
        if not self.dueling:
            return heads, state
        value, advantage = heads[..., :1], heads[..., 1:]
        return value + advantage - advantage.mean(dim=-1, keepdim=True), state
