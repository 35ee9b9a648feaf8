"""R2D1: recurrent DQN with sequence replay (R2D2, Kapturowski et al. 2019, on one machine).

Reads top to bottom, as `rlplex.algos.dqn`: `optimize_agent` (the `ReplayAlgo` loop) stores
the batch's sequences (`sampler_to_buffer`, which AsyncRl's copiers call too), sets epsilon
and beta, then runs `updates_per_itr` updates. One update, in `_update` and `sequence_loss`:

  1. a minibatch of sequences of burn_in + learn_length + n_step steps, each with the
     recurrent state the sampler had before its first step (uniform or prioritized);
  2. burn-in: the online and the target network run the first `burn_in` steps from that
     stored state without gradient, to a fresher state for both;
  3. from there both run the rest; for each of the `learn_length` steps t the target is
     h(r_t + ... + gamma^(n-1) r_(t+n-1) + gamma^n h^-1(Q'(s_(t+n), argmax_a Q(s_(t+n), a))))
     (double Q, n-step, the value rescaling h of `rl_math.value_rescale`); an episode end
     inside the n steps cuts the return there without bootstrap (a time-limit truncation
     too, as rlpyt's R2D1), and the LSTM state restarts after it;
  4. the loss is the importance-weighted mean of 0.5 (Q(s_t, a_t) - target)^2; one Adam step;
  5. each sequence's new priority is eta * max_t |delta_t| + (1 - eta) * mean_t |delta_t|
     (eta = 0.9), + eps, to the power alpha;
  6. every `target_update_interval` updates the target network becomes the online one.

Sequences start every `learn_length` steps of each environment's stream. They run on across
batch boundaries (`SequenceCarry`), so every step after the first burn-in is trained and
`batch_T` may be shorter than a sequence. Under AsyncRl, whose two copier processes cut
alternate batches in turn, the carry is in shared memory (`copier_factory`).

Batch sizes count sequences. For AsyncRl's replay-ratio throttle, `batch_size` is the number
of steps one update learns from (sequences x learn_length) and `learning_starts` counts
sequences in the replay.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch
from pydantic import Field

from rlplex.agents.recurrent import R2d1Agent, sequence_resets
from rlplex.algos.off_policy import ReplayAlgo
from rlplex.algos.optim_state import adam
from rlplex.algos.rl_math import inverse_value_rescale, value_rescale
from rlplex.config import StrictModel
from rlplex.errors import ConfigError, RlplexError, SnapshotError
from rlplex.models import unwrap_model
from rlplex.models.device import model_device, to_numpy
from rlplex.models.recurrent import RecurrentQNet
from rlplex.processes import CONTEXT
from rlplex.replays.sequence import CarryHandle, SequenceCarry, SequenceReplayBuffer, sequences_of
from rlplex.samplers.batch import SampleBatch


class SequencePriorityConfig(StrictModel):
    alpha: float = Field(0.9, gt=0, le=1, description="priority = (mixed |TD error| + eps) ** alpha")
    beta0: float = Field(0.6, ge=0, le=1, description="importance-weight exponent at the start, annealed to 1")
    eta: float = Field(0.9, ge=0, le=1, description="a sequence's priority: eta * max |delta| + (1 - eta) * mean")
    eps: float = Field(1e-6, gt=0, description="keeps every sequence's priority positive")


class R2D1Config(StrictModel):
    learning_rate: float = Field(1e-3, gt=0, description="Adam's step size")
    buffer_size: int = Field(2000, ge=1, description="sequences")
    batch_size: int = Field(32, ge=1, description="sequences per gradient step")
    learning_starts: int = Field(64, ge=0, description="sequences in the replay before the first update")
    burn_in: int = Field(10, ge=0, description="steps that only warm the recurrent state up (no gradient)")
    learn_length: int = Field(20, ge=1, description="steps of each sequence that are trained on")
    n_step: int = Field(5, ge=1, description="steps of reward before the bootstrap")
    gamma: float = Field(0.99, ge=0, le=1, description="discount factor")
    target_update_interval: int = Field(100, ge=1, description="gradient steps between target-network copies")
    updates_per_itr: int = Field(4, ge=0, description="gradient steps per sampler batch")
    double: bool = Field(True, description="the double-DQN target: a* from the online network")
    dueling: bool = Field(True, description="value and advantage heads (the agent's network)")
    value_rescale: bool = Field(True, description="R2D2's h(x) on the targets")
    rescale_eps: float = Field(1e-3, gt=0, description="the eps of h(x) = sign(x) (sqrt(|x| + 1) - 1) + eps x")
    prioritized: SequencePriorityConfig | None = Field(
        default_factory=SequencePriorityConfig, description="prioritized sequence replay; none: uniform"
    )
    max_grad_norm: float = Field(10.0, gt=0, description="gradients are clipped to this global norm")
    exploration_fraction: float = Field(0.3, gt=0, le=1, description="share of the run over which epsilon decays")
    eps_initial: float = Field(1.0, ge=0, le=1, description="epsilon of the epsilon-greedy acting at the start")
    eps_final: float = Field(0.02, ge=0, le=1, description="epsilon from exploration_fraction of the run on")
    snapshot_replay: bool = Field(True, description="put the replay buffer in snapshots (exact resume)")

    @property
    def sequence_length(self) -> int:
        return self.burn_in + self.learn_length + self.n_step


def sequence_loss(
    online: torch.nn.Module, target: torch.nn.Module, batch: dict[str, torch.Tensor], cfg: R2D1Config
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, |delta| [learn_length, N], Q(s_t, a_t)) of a minibatch of sequences whose fields
    are time-major: observation [L, N, O], action, reward, done, reset [L, N], rnn_h/rnn_c [N, H]."""
    burn, learn, n = cfg.burn_in, cfg.learn_length, cfg.n_step
    obs, reset = batch["observation"], batch["reset"]
    state = (batch["rnn_h"], batch["rnn_c"])
    with torch.no_grad():  # burn-in: a fresher state for both networks, no gradient through it
        online_state, target_state = state, state
        if burn > 0:
            _, online_state = online(obs[:burn], state, reset[:burn])
            _, target_state = target(obs[:burn], state, reset[:burn])
        q_target, _ = target(obs[burn:], target_state, reset[burn:])  # [learn + n, N, A]
    q_online, _ = online(obs[burn:], online_state, reset[burn:])

    # n-step returns from each learned step t, cut at the first episode end.
    reward, done = batch["reward"][burn:], batch["done"][burn:].float()
    returns = torch.zeros_like(reward[:learn])
    alive = torch.ones_like(returns)
    for k in range(n):
        returns = returns + alive * cfg.gamma**k * reward[k : k + learn]
        alive = alive * (1.0 - done[k : k + learn])
    with torch.no_grad():
        chooser = q_online if cfg.double else q_target
        next_action = chooser[n : n + learn].argmax(dim=-1, keepdim=True)
        next_q = q_target[n : n + learn].gather(-1, next_action).squeeze(-1)
        if cfg.value_rescale:
            next_q = inverse_value_rescale(next_q, cfg.rescale_eps)
        y = returns + alive * cfg.gamma**n * next_q
        if cfg.value_rescale:
            y = value_rescale(y, cfg.rescale_eps)
    q = q_online[:learn].gather(-1, batch["action"][burn : burn + learn].long().unsqueeze(-1)).squeeze(-1)
    delta = q - y
    per_sequence = 0.5 * delta.pow(2).mean(dim=0)
    loss = (batch["weight"] * per_sequence).mean() if "weight" in batch else per_sequence.mean()
    return loss, delta.detach().abs(), q.detach()


class R2D1(ReplayAlgo):
    name = "R2D1"

    def __init__(self, config: R2D1Config | None = None, seed: int = 0) -> None:
        self.config = config or R2D1Config()
        self.seed = seed
        self.agent: R2d1Agent | None = None
        self.target: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.replay: Any = None
        self.n_itr = 1
        self.update_count = 0
        self.beta = self.config.prioritized.beta0 if self.config.prioritized else 1.0
        self._rng = np.random.default_rng(seed)
        # Made by `initialize`, or in shared memory by `copier_factory` (AsyncRl's copiers cut
        # through it in turn, and never initialize).
        self._carry: SequenceCarry | None = None

    @property
    def batch_size(self) -> int:
        return self.config.batch_size * self.config.learn_length

    def initialize(self, agent: Any, n_itr: int, world_size: int = 1, shared_replay: bool = False) -> None:
        if not isinstance(agent, R2d1Agent):
            raise RlplexError(f"R2D1 needs an R2d1Agent, got {type(agent).__name__}")
        online = unwrap_model(agent.model)
        assert isinstance(online, RecurrentQNet)
        if online.dueling != self.config.dueling:
            raise ConfigError(f"R2D1: the config asks for dueling={self.config.dueling}, the agent's network has not")
        self.agent = agent
        self.device = model_device(online)
        self.n_itr = max(1, n_itr)
        self.target = copy.deepcopy(online)
        self.target.requires_grad_(False)
        self.optimizer = adam(agent.model.parameters(), lr=self.config.learning_rate)
        cfg = self.config
        self.replay = SequenceReplayBuffer.create(
            agent.spaces,
            cfg.buffer_size,
            cfg.sequence_length,
            agent.state_size,
            prioritized=cfg.prioritized is not None,
            shared=shared_replay,
            lock=CONTEXT.Lock() if shared_replay else None,
        )
        agent.set_epsilon(self.epsilon_at(0))
        # A shared replay is AsyncRl's: its carry is made for the sampler's batch_B by `copier_factory`.
        self._carry = None if shared_replay else SequenceCarry(cfg.sequence_length, cfg.learn_length)

    def copier_factory(self, batch_B: int) -> Callable[[], R2D1]:
        """What builds this algorithm in AsyncRl's copier processes: one attached to a sequence
        carry in shared memory, which the copiers cut their batches through in turn (so
        sequences run on across batches there too) and this learner snapshots."""
        if self.agent is None or self.replay is None:
            raise RlplexError("R2D1.copier_factory called before initialize()")
        if self._carry is None:
            cfg, agent = self.config, self.agent
            self._carry = SequenceCarry.create_shared(
                cfg.sequence_length, cfg.learn_length, agent.spaces, batch_B, agent.state_size
            )
        return partial(_copier_r2d1, self.config, self._carry.handle)

    def sampler_to_buffer(self, samples: SampleBatch) -> dict[str, np.ndarray]:
        """Sequences of burn_in + learn_length + n_step steps, one every learn_length steps."""
        if self._carry is not None:
            return self._carry.cut(samples)
        return sequences_of(samples, self.config.sequence_length, self.config.learn_length)

    def shutdown(self) -> None:
        super().shutdown()
        if self._carry is not None:
            self._carry.close()

    def epsilon_at(self, itr: int) -> float:
        cfg = self.config
        progress = min(1.0, itr / (cfg.exploration_fraction * self.n_itr))
        return cfg.eps_initial + (cfg.eps_final - cfg.eps_initial) * progress

    def _explore(self, itr: int) -> dict[str, float]:
        assert self.agent is not None
        epsilon = self.epsilon_at(itr + 1)
        self.agent.set_epsilon(epsilon)
        per = self.config.prioritized
        self.beta = 1.0 if per is None else per.beta0 + (1.0 - per.beta0) * min(1.0, (itr + 1) / self.n_itr)
        return {"charts/epsilon": epsilon, "charts/per_beta": self.beta}

    def _updates(self, n: int) -> dict[str, float]:
        stats = np.array([self._update() for _ in range(n)])
        return {
            "losses/td": float(stats[:, 0].mean()),
            "losses/q_mean": float(stats[:, 1].mean()),
            "losses/grad_norm": float(stats[:, 2].mean()),
        }

    def minibatch(self) -> tuple[dict[str, torch.Tensor], np.ndarray, np.ndarray]:
        """Sequences from the replay as time-major tensors, and their (index, serial)."""
        assert self.replay is not None
        arrays = self.replay.sample(self.config.batch_size, self._rng, beta=self.beta)
        idx, serial = arrays.pop("index"), arrays.pop("serial")
        arrays["reset"] = sequence_resets(arrays["done"].T, np.zeros_like(arrays["done"].T)).T
        batch = {}
        for name, value in arrays.items():
            tensor = torch.as_tensor(value, device=self.device)
            batch[name] = tensor if name in ("rnn_h", "rnn_c", "weight") else tensor.transpose(0, 1)
        return batch, idx, serial

    def _update(self) -> tuple[float, float, float]:
        assert self.agent is not None and self.optimizer is not None and self.target is not None
        cfg, model = self.config, self.agent.model
        batch, idx, serial = self.minibatch()
        loss, abs_delta, q = sequence_loss(model, self.target, batch, cfg)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        self.optimizer.step()
        per = cfg.prioritized
        if per is not None:
            mixed = per.eta * abs_delta.max(dim=0).values + (1 - per.eta) * abs_delta.mean(dim=0)
            self.replay.update_priorities(idx, (to_numpy(mixed.double()) + per.eps) ** per.alpha, serial)
        self.update_count += 1
        if self.update_count % cfg.target_update_interval == 0:
            self.target.load_state_dict(unwrap_model(model).state_dict())
        return float(loss.detach()), float(q.mean()), float(grad_norm)

    # ----- snapshots ------------------------------------------------------------------------
    def _variant(self) -> dict[str, Any]:
        cfg = self.config
        return {"dueling": cfg.dueling, "prioritized": cfg.prioritized is not None, "length": cfg.sequence_length}

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None or self.target is None or self.replay is None:
            raise RlplexError("R2D1.state_dict called before initialize()")
        return {
            "optimizer": self.optimizer.state_dict(),
            "target": {k: v.clone() for k, v in self.target.state_dict().items()},
            "update_count": self.update_count,
            "rng": self._rng.bit_generator.state,
            "replay": self.replay.state_dict(include_data=self.config.snapshot_replay),
            "variant": self._variant(),
            "carry": {} if self._carry is None else self._carry.state_dict(self.replay.wait_check),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.optimizer is None or self.target is None or self.replay is None:
            raise RlplexError("R2D1.load_state_dict called before initialize()")
        if "target" not in state or "variant" not in state:
            raise SnapshotError(f"not an R2D1 snapshot: its algorithm state holds {sorted(state)}")
        if state["variant"] != self._variant():
            raise SnapshotError(
                f"the snapshot is of an R2D1 with {state['variant']}, this config asks for {self._variant()}"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        self.target.load_state_dict(state["target"])
        self.update_count = int(state["update_count"])
        self._rng.bit_generator.state = state["rng"]
        self.replay.load_state_dict(state["replay"])
        if self._carry is not None:  # a snapshot from before the carry: sequences start afresh
            self._carry.load_state_dict(state.get("carry", {}))


def _copier_r2d1(config: R2D1Config, carry: CarryHandle) -> R2D1:
    """An AsyncRl copier's R2D1 (module-level: the factory is sent to a spawned process)."""
    algo = R2D1(config)
    algo._carry = SequenceCarry.attach(carry)
    return algo
