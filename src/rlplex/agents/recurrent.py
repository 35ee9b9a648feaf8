"""Recurrent agents: an LSTM policy-gradient agent (PPO, A2C) and the R2D1 agent.

A recurrent agent keeps one LSTM state per environment of the batch it acts on. Samplers
call `reset_state(done_B)` after every step with the environments whose episode just ended
(their state restarts at zero before the next step); the evaluator calls
`reset_eval_state()` before its episodes, which use a state of their own so that evaluating
never disturbs the sampler's. Every step records the state it started from
(`agent_info["rnn_h"]`, `["rnn_c"]`): training replays a stored sequence from the state at
its first step, resetting where the previous step ended an episode (`sequence_resets`).
Under the parallel sampler each worker's agent copy keeps the state of its own environments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from rlplex.agents.base import InfoSpec
from rlplex.agents.dqn import EpsilonGreedy
from rlplex.agents.pg import CategoricalPgAgent
from rlplex.envs import EnvSpaces, describe_action_space
from rlplex.errors import ConfigError
from rlplex.models import unwrap_model
from rlplex.models.device import model_device, to_numpy, to_tensor
from rlplex.models.recurrent import RecurrentActorCritic, RecurrentQNet, State

if TYPE_CHECKING:  # samplers import agents.base; a run-time import here would be circular
    from rlplex.samplers.batch import SampleBatch


@runtime_checkable
class RecurrentAgent(Protocol):
    """What samplers and the evaluator call on an agent that carries state between steps."""

    def reset_state(self, done_B: np.ndarray) -> None: ...

    def reset_eval_state(self) -> None: ...


def state_info_spec(state_size: int) -> InfoSpec:
    return {"rnn_h": ((state_size,), np.float32), "rnn_c": ((state_size,), np.float32)}


def sequence_resets(terminated_T_B: np.ndarray, truncated_T_B: np.ndarray) -> np.ndarray:
    """reset[t] = the episode ended at step t - 1; never at t = 0, whose stored state is
    already the one after any reset."""
    done = terminated_T_B | truncated_T_B
    reset = np.zeros_like(done)
    reset[1:] = done[:-1]
    return reset


class _StatefulActing:
    """The per-environment sampling state and the separate evaluation state, on the model's device."""

    model: nn.Module
    state_size: int  # the width of h and of c
    _state: State | None
    _eval_state: State | None

    def _init_states(self, state_size: int) -> None:
        self.state_size = state_size
        self._state = None
        self._eval_state = None

    def _current(self, state: State | None, batch: int) -> State:
        if state is None or state[0].shape[0] != batch:
            zeros = torch.zeros(batch, self.state_size, device=model_device(self.model))
            return zeros, zeros.clone()
        return state

    def reset_state(self, done_B: np.ndarray) -> None:
        if self._state is not None and done_B.any():
            keep = to_tensor(~done_B, self._state[0].device, torch.float32).unsqueeze(-1)
            self._state = (self._state[0] * keep, self._state[1] * keep)

    def reset_eval_state(self) -> None:
        self._eval_state = None


class RecurrentCategoricalPgAgent(_StatefulActing, CategoricalPgAgent):
    """A categorical policy and value over one LSTM trunk (`RecurrentActorCritic`).

    For PPO and A2C, `training_batch` lays a [T, B] batch out per environment sequence,
    [B, T, ...], with each sequence's start state and resets: minibatches are whole
    sequences (split by environment, not by time step), in time order.
    """

    def __init__(self, spaces: EnvSpaces, hidden: Sequence[int] = (64,), lstm_size: int = 64) -> None:
        if spaces.action_kind != "discrete":
            raise ConfigError(
                f"the recurrent policy-gradient agent needs a Discrete action space; the environment's is "
                f"{describe_action_space(spaces)}"
            )
        self.spaces = spaces
        # The state holds the policy's and the value's LSTM states side by side.
        self.info_spec = {"log_prob": ((), np.float32), "value": ((), np.float32), **state_info_spec(2 * lstm_size)}
        self.model = RecurrentActorCritic(int(np.prod(spaces.obs_shape)), spaces.n_actions, hidden, lstm_size)
        self._init_states(2 * lstm_size)

    @property
    def net(self) -> RecurrentActorCritic:
        inner = unwrap_model(self.model)
        assert isinstance(inner, RecurrentActorCritic)
        return inner

    @torch.no_grad()
    def step(self, observation_B_O: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        obs = to_tensor(observation_B_O, self.device, torch.float32)
        state = self._current(self._state, len(obs))
        logits, value, self._state = self.model(obs.unsqueeze(0), state)
        action, log_prob = self._sample(logits[0])
        info = {"log_prob": to_numpy(log_prob), "value": to_numpy(value[0])}
        return to_numpy(action), {**info, "rnn_h": to_numpy(state[0]), "rnn_c": to_numpy(state[1])}

    @torch.no_grad()
    def eval_step(self, observation_B_O: np.ndarray) -> np.ndarray:
        obs = to_tensor(observation_B_O, self.device, torch.float32)
        logits, _, self._eval_state = self.model(obs.unsqueeze(0), self._current(self._eval_state, len(obs)))
        return to_numpy(self._mode(logits[0]))

    def training_batch(self, samples: SampleBatch, **extra_T_B: np.ndarray) -> dict[str, torch.Tensor]:
        """Per environment: `observation` [B, T, O], `action`, each of `extra_T_B` [B, T],
        `reset` [B, T] and the state at each sequence's start, `rnn_h`/`rnn_c` [B, H]."""
        columns = {"observation": samples.observation, "action": samples.action, **extra_T_B}
        device = self.device
        batch = {k: to_tensor(np.swapaxes(v, 0, 1), device) for k, v in columns.items()}
        batch["reset"] = to_tensor(sequence_resets(samples.terminated, samples.truncated).T, device)
        batch["rnn_h"] = to_tensor(samples.agent_info["rnn_h"][0], device)
        batch["rnn_c"] = to_tensor(samples.agent_info["rnn_c"][0], device)
        return batch

    def evaluate_batch(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log_prob, entropy, value), each [B, T], replaying the sequences from their start states."""
        obs_T_B = batch["observation"].transpose(0, 1)
        logits, value, _ = self.model(obs_T_B, (batch["rnn_h"], batch["rnn_c"]), batch["reset"].T)
        log_prob, entropy = self.log_prob_entropy(logits, batch["action"].T)
        return log_prob.T, entropy.T, value.T

    @torch.no_grad()
    def next_values(self, samples: SampleBatch) -> np.ndarray:
        """V(next_observation[t]) [T, B] with the state after step t (before any reset: at a
        time-limit truncation the final observation is valued with the episode's own state)."""
        net, device = self.net, self.device
        obs = to_tensor(samples.observation, device)
        reset = to_tensor(sequence_resets(samples.terminated, samples.truncated), device)
        start = (to_tensor(samples.agent_info["rnn_h"][0], device), to_tensor(samples.agent_info["rnn_c"][0], device))
        _, v_start = net.split(start)
        h, c = net.v_trunk.states_after_each_step(obs, v_start, reset)
        T, B = samples.T, samples.B
        next_obs = to_tensor(samples.next_observation, device).reshape(1, T * B, -1)
        out, _ = net.v_trunk(next_obs, (h.reshape(T * B, -1), c.reshape(T * B, -1)))
        return to_numpy(net.value_head(out).reshape(T, B))

    def evaluate(
        self, observation: torch.Tensor, action: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError("a recurrent agent evaluates whole sequences: use evaluate_batch(training_batch())")

    def value(self, observation: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a recurrent agent values whole sequences: use next_values(samples)")


class R2d1Agent(_StatefulActing, EpsilonGreedy):
    """Epsilon-greedy over a recurrent Q-network (`RecurrentQNet`); epsilon is the model's
    buffer, as `DqnAgent`'s, so that it reaches sampler processes with the weights."""

    def __init__(
        self, spaces: EnvSpaces, hidden: Sequence[int] = (64,), lstm_size: int = 64, dueling: bool = True
    ) -> None:
        if spaces.action_kind != "discrete":
            raise ConfigError(
                f"R2D1 needs a Discrete action space; the environment's is {describe_action_space(spaces)}"
            )
        self.spaces = spaces
        self.info_spec: InfoSpec = state_info_spec(lstm_size)
        self.model: nn.Module = RecurrentQNet(
            int(np.prod(spaces.obs_shape)), spaces.n_actions, hidden, lstm_size, dueling
        )
        self._init_states(lstm_size)

    @torch.no_grad()
    def step(self, observation_B_O: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        obs = to_tensor(observation_B_O, model_device(self.model), torch.float32)
        state = self._current(self._state, len(obs))
        q, self._state = self.model(obs.unsqueeze(0), state)
        action = self.explore(q[0].argmax(dim=-1))
        return to_numpy(action), {"rnn_h": to_numpy(state[0]), "rnn_c": to_numpy(state[1])}

    @torch.no_grad()
    def eval_step(self, observation_B_O: np.ndarray) -> np.ndarray:
        obs = to_tensor(observation_B_O, model_device(self.model), torch.float32)
        q, self._eval_state = self.model(obs.unsqueeze(0), self._current(self._eval_state, len(obs)))
        return to_numpy(q[0].argmax(dim=-1))
