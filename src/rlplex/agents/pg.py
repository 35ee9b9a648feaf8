"""Policy-gradient agents: categorical (discrete actions) and Gaussian (continuous actions),
behind the observation encoder their space calls for (`rlplex.models.encoders`: the Nature
CNN for images, shared by the policy and value heads)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from rlplex.agents.base import InfoSpec
from rlplex.envs import EnvSpaces
from rlplex.errors import ConfigError
from rlplex.models import ActorCriticMlp, GaussianActorCriticMlp, unwrap_model
from rlplex.models.device import model_device, to_numpy
from rlplex.models.encoders import EncoderKind, as_obs_tensor, default_hidden, make_encoder

if TYPE_CHECKING:  # samplers import agents.base; a run-time import here would be circular
    from rlplex.samplers.batch import SampleBatch

_LOG_2PI = math.log(2 * math.pi)


class PgAgent:
    """Shared acting logic; subclasses define the distribution."""

    model: nn.Module

    def __init__(self, spaces: EnvSpaces) -> None:
        self.spaces = spaces
        self.info_spec: InfoSpec = {"log_prob": ((), np.float32), "value": ((), np.float32)}

    # Subclasses: sample / log-prob / entropy / mode from the model's raw output.
    def _sample(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _mode(self, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def log_prob_entropy(self, out: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return model_device(self.model)

    @torch.no_grad()
    def step(self, observation_B_O: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        out, value_B = self.model(as_obs_tensor(observation_B_O, self.device))
        action, log_prob_B = self._sample(out)
        return to_numpy(action), {"log_prob": to_numpy(log_prob_B), "value": to_numpy(value_B)}

    @torch.no_grad()
    def eval_step(self, observation_B_O: np.ndarray) -> np.ndarray:
        out, _ = self.model(as_obs_tensor(observation_B_O, self.device))
        return to_numpy(self._mode(out))

    def evaluate(
        self, observation: torch.Tensor, action: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log_prob, entropy, value) with gradients, in one forward pass of `model`."""
        out, value = self.model(observation)
        log_prob, entropy = self.log_prob_entropy(out, action)
        return log_prob, entropy, value

    @torch.no_grad()
    def value(self, observation: torch.Tensor) -> torch.Tensor:
        return self.model(observation)[1]

    # What PPO and A2C call: a batch as tensors whose first axis minibatches draw from (single
    # steps here; whole environment sequences for a recurrent agent), and the losses' inputs.
    def training_batch(self, samples: SampleBatch, **extra_T_B: np.ndarray) -> dict[str, torch.Tensor]:
        """`observation`, `action` and each of `extra_T_B` ([T, B] arrays), flattened to [T * B, ...],
        on the model's device."""
        columns = {"observation": samples.observation, "action": samples.action, **extra_T_B}
        n, device = samples.T * samples.B, self.device
        return {k: torch.as_tensor(v.reshape(n, *v.shape[2:]), device=device) for k, v in columns.items()}

    def evaluate_batch(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log_prob, entropy, value) with gradients for (a minibatch of) `training_batch`."""
        return self.evaluate(batch["observation"], batch["action"])

    def next_values(self, samples: SampleBatch) -> np.ndarray:
        """V(next_observation) [T, B], the bootstrap of every step."""
        T, B = samples.T, samples.B
        next_obs = as_obs_tensor(samples.next_observation.reshape(T * B, *samples.observation.shape[2:]), self.device)
        return to_numpy(self.value(next_obs)).reshape(T, B)


class CategoricalPgAgent(PgAgent):
    def __init__(self, spaces: EnvSpaces, hidden: Sequence[int] | None = None, encoder: EncoderKind = "auto") -> None:
        if spaces.action_kind != "discrete":
            raise ConfigError("CategoricalPgAgent needs a Discrete action space; use GaussianPgAgent for Box actions")
        super().__init__(spaces)
        features, in_dim = make_encoder(spaces, encoder, "CategoricalPgAgent (ppo, a2c)")
        hidden = default_hidden(features) if hidden is None else hidden
        self.model = ActorCriticMlp(in_dim, spaces.n_actions, hidden, features)

    def _sample(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_p = torch.log_softmax(out, dim=-1)
        # Inverse-CDF sampling: the first action whose cumulative probability reaches a uniform
        # draw (a third of `torch.multinomial`'s cost for a handful of rows). The clamp covers
        # a total probability that rounds to just under the draw.
        below = log_p.exp().cumsum(-1) < torch.rand(out.shape[:-1], device=out.device).unsqueeze(-1)
        action = below.sum(-1, keepdim=True).clamp_(max=out.shape[-1] - 1)
        return action.squeeze(-1), log_p.gather(-1, action).squeeze(-1)

    def _mode(self, out: torch.Tensor) -> torch.Tensor:
        return out.argmax(dim=-1)

    def log_prob_entropy(self, out: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_p = torch.log_softmax(out, dim=-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        return log_p.gather(-1, action.long().unsqueeze(-1)).squeeze(-1), entropy


class GaussianPgAgent(PgAgent):
    """Diagonal Gaussian policy; actions are sampled unclipped (the sampler clips what the env sees)."""

    def __init__(
        self,
        spaces: EnvSpaces,
        hidden: Sequence[int] | None = None,
        init_log_std: float = 0.0,
        encoder: EncoderKind = "auto",
    ) -> None:
        if spaces.action_kind != "continuous":
            raise ConfigError("GaussianPgAgent needs a Box action space; use CategoricalPgAgent for Discrete")
        super().__init__(spaces)
        features, in_dim = make_encoder(spaces, encoder, "GaussianPgAgent (ppo, a2c)")
        hidden = default_hidden(features) if hidden is None else hidden
        self.model = GaussianActorCriticMlp(in_dim, int(np.prod(spaces.action_shape)), hidden, init_log_std, features)

    @property
    def _log_std(self) -> torch.Tensor:
        log_std = unwrap_model(self.model).log_std  # the model is DDP-wrapped under SyncRl
        assert isinstance(log_std, torch.Tensor)
        return log_std

    def _sample(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn_like(out)
        action = out + noise * self._log_std.exp()
        log_prob = (-0.5 * noise.pow(2) - self._log_std - 0.5 * _LOG_2PI).sum(-1)
        return action, log_prob

    def _mode(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def log_prob_entropy(self, out: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_std = self._log_std.expand_as(out)
        z = (action - out) / log_std.exp()
        log_prob = (-0.5 * z.pow(2) - log_std - 0.5 * _LOG_2PI).sum(-1)
        entropy = (0.5 + 0.5 * _LOG_2PI + log_std).sum(-1)
        return log_prob, entropy
