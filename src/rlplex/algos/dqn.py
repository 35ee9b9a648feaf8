"""DQN with a replay buffer and a target network, and the Rainbow options that CartPole-scale
runs use: the double-DQN target, a dueling head, n-step returns, prioritized replay and the
categorical (C51) value distribution. Each option is a field of `DQNConfig`; the network
options (dueling, C51) are the agent's (`DQNConfig.agent_options()` builds it to match).

Reads top to bottom: `optimize_agent` stores the new samples (the selection that
`sampler_to_buffer` makes, which AsyncRl's copier processes call too), sets epsilon (and the
importance-weight exponent beta) for the next batch, then does `updates_per_itr` gradient
steps. One step, in `_update`:

  1. a minibatch: uniform, or in proportion to priorities with importance weights; n-step
     transitions are assembled by the replay at sample time (`rlplex.replays.nstep`);
  2. the target: r_n + gamma^k Q'(s_k, a*) (`td_target`), or for C51 the target network's
     distribution at a*, shifted and shrunk by r_n + gamma^k z and projected back onto the
     support (`project_distribution`); a* = argmax of the online (double) or target net;
  3. the loss per transition (Huber/MSE, or C51's cross-entropy), weighted, one Adam step;
  4. the sampled transitions' new priorities (|TD error| or the cross-entropy, + eps)^alpha;
  5. every `target_update_interval` steps, the target network becomes a copy of the online one.

Epsilon and beta follow the iteration index, so they are pure functions of progress: after
resuming from a snapshot they continue where they were (rlpyt restarted epsilon at 1).
Epsilon lives in the model's `epsilon` buffer, so it reaches sampler processes with the weights.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from rlplex.agents.dqn import DqnAgent
from rlplex.algos.off_policy import ReplayAlgo
from rlplex.algos.optim_state import adam
from rlplex.config import StrictModel
from rlplex.errors import ConfigError, RlplexError, SnapshotError
from rlplex.models import QMlp, unwrap_model
from rlplex.models.device import model_device, to_numpy
from rlplex.replays import PrioritizedReplayBuffer, UniformReplayBuffer


class PrioritizedConfig(StrictModel):
    alpha: float = Field(0.6, gt=0, le=1, description="priority = (|TD error| + eps) ** alpha")
    beta0: float = Field(0.4, ge=0, le=1, description="importance-weight exponent at the start, annealed to 1")
    eps: float = Field(1e-6, gt=0, description="keeps every transition's priority positive")


class C51Config(StrictModel):
    atoms: int = Field(51, ge=2, description="points of the support")
    v_min: float = Field(-10.0, description="the support's lowest return")
    v_max: float = Field(10.0, description="the support's highest return")

    @model_validator(mode="after")
    def _ordered(self) -> C51Config:
        if not self.v_min < self.v_max:
            raise ValueError(f"v_min ({self.v_min}) must be below v_max ({self.v_max})")
        return self


class DQNConfig(StrictModel):
    learning_rate: float = Field(2.3e-3, gt=0, description="Adam's step size")
    buffer_size: int = Field(100_000, ge=1, description="replay capacity, in transitions")
    batch_size: int = Field(64, ge=1, description="transitions per gradient step")
    learning_starts: int = Field(1000, ge=0, description="transitions in the replay before the first update")
    # In gradient steps. rl-zoo's "10" is in env steps and SB3 copies only while collecting,
    # i.e. once per train call: with 128 updates per call that is every 128 updates.
    target_update_interval: int = Field(128, ge=1, description="gradient steps between target-network copies")
    updates_per_itr: int = Field(128, ge=0, description="gradient steps per sampler batch (the train frequency)")
    gamma: float = Field(0.99, ge=0, le=1, description="discount factor")
    double: bool = Field(True, description="the double-DQN target: a* from the online network")
    dueling: bool = Field(False, description="value and advantage heads (the agent's network)")
    n_step: int = Field(1, ge=1, description="steps of reward before the bootstrap")
    prioritized: PrioritizedConfig | None = Field(None, description="prioritized replay; none: uniform")
    categorical: C51Config | None = Field(None, description="C51 value distribution; none: expected values")
    loss: Literal["huber", "mse"] = Field("huber", description="of the TD error (not used by C51)")
    max_grad_norm: float = Field(10.0, gt=0, description="gradients are clipped to this global norm")
    exploration_fraction: float = Field(0.16, gt=0, le=1, description="share of the run over which epsilon decays")
    eps_initial: float = Field(1.0, ge=0, le=1, description="epsilon of the epsilon-greedy acting at the start")
    eps_final: float = Field(0.04, ge=0, le=1, description="epsilon from exploration_fraction of the run on")
    snapshot_replay: bool = Field(True, description="put the replay buffer in snapshots (exact resume)")

    def agent_options(self) -> dict[str, Any]:
        """The `DqnAgent` keyword arguments whose network this config trains."""
        c51 = self.categorical
        if c51 is None:
            return {"dueling": self.dueling}
        return {"dueling": self.dueling, "n_atoms": c51.atoms, "v_min": c51.v_min, "v_max": c51.v_max}


def _q(module: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """Q-values of a network's output (the expectation, for a C51 network)."""
    inner = unwrap_model(module)
    q: torch.Tensor = inner.q_values(out) if isinstance(inner, QMlp) else out
    return q


def td_target(
    batch: dict[str, torch.Tensor], online: nn.Module, target: nn.Module, gamma: float, double: bool
) -> torch.Tensor:
    """r + discount * Q_target(s', a') for non-terminal s', a' = argmax of the online (double) or
    target net; discount is the batch's (gamma^k of an n-step transition), else `gamma`."""
    with torch.no_grad():
        next_q_B_A = target(batch["next_observation"])
        if double:
            next_action_B = online(batch["next_observation"]).argmax(dim=-1, keepdim=True)
            next_value_B = next_q_B_A.gather(-1, next_action_B).squeeze(-1)
        else:
            next_value_B = next_q_B_A.max(dim=-1).values
        discount = batch.get("discount", gamma)
        not_terminal_B = 1.0 - batch["terminated"].float()
        target_B: torch.Tensor = batch["reward"] + discount * not_terminal_B * next_value_B
        return target_B


def project_distribution(
    probs_B_K: torch.Tensor, reward_B: torch.Tensor, discount_B: torch.Tensor, support_K: torch.Tensor
) -> torch.Tensor:
    """C51's projection: the distribution of r + discount * Z, Z ~ `probs` on `support`, put back
    on `support`. Each atom's mass is split between the two support points around its shifted
    value, in proportion to closeness; values beyond the ends go to the ends."""
    n_atoms = support_K.numel()
    v_min, v_max = float(support_K[0]), float(support_K[-1])
    delta = (v_max - v_min) / (n_atoms - 1)
    shifted_B_K = (reward_B.unsqueeze(-1) + discount_B.unsqueeze(-1) * support_K).clamp(v_min, v_max)
    position_B_K = ((shifted_B_K - v_min) / delta).clamp(0, n_atoms - 1)
    lower, upper = position_B_K.floor().long(), position_B_K.ceil().long()
    projected = torch.zeros_like(probs_B_K)
    projected.scatter_add_(-1, lower, probs_B_K * (upper.to(probs_B_K.dtype) - position_B_K))
    projected.scatter_add_(-1, upper, probs_B_K * (position_B_K - lower.to(probs_B_K.dtype)))
    # On a support point both shares above are 0: the whole mass goes there.
    projected.scatter_add_(-1, lower, probs_B_K * (lower == upper).to(probs_B_K.dtype))
    return projected


def categorical_target(
    batch: dict[str, torch.Tensor], online: nn.Module, target: nn.Module, double: bool
) -> torch.Tensor:
    """The projected target distribution [B, K] of a C51 minibatch."""
    with torch.no_grad():
        next_logits_B_A_K = target(batch["next_observation"])
        chooser_logits = online(batch["next_observation"]) if double else next_logits_B_A_K
        next_action_B = _q(online, chooser_logits).argmax(dim=-1)
        probs_B_K = torch.softmax(
            next_logits_B_A_K[torch.arange(len(next_action_B), device=next_action_B.device), next_action_B], dim=-1
        )
        support = unwrap_model(online).support
        assert isinstance(support, torch.Tensor)
        discount_B = batch["discount"] * (1.0 - batch["terminated"].float())
        return project_distribution(probs_B_K, batch["reward"], discount_B, support)


class DQN(ReplayAlgo):
    name = "DQN"

    def __init__(self, config: DQNConfig | None = None, seed: int = 0) -> None:
        self.config = config or DQNConfig()
        self.seed = seed
        self.agent: DqnAgent | None = None
        self.target: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.replay: UniformReplayBuffer | None = None
        self.n_itr = 1
        self.update_count = 0
        self.beta = self.config.prioritized.beta0 if self.config.prioritized else 1.0
        self._rng = np.random.default_rng(seed)

    def initialize(self, agent: Any, n_itr: int, world_size: int = 1, shared_replay: bool = False) -> None:
        """`shared_replay` puts the replay buffer in shared memory (AsyncRl's copiers write into it)."""
        if not isinstance(agent, DqnAgent):
            raise RlplexError(f"DQN needs a DqnAgent, got {type(agent).__name__}")
        online = unwrap_model(agent.model)
        self._check_network(online)
        self.agent = agent
        self.device = model_device(online)
        self.n_itr = max(1, n_itr)
        self.target = copy.deepcopy(online)
        self.target.requires_grad_(False)
        self.optimizer = adam(agent.model.parameters(), lr=self.config.learning_rate)
        self._make_replay(agent, shared_replay, prioritized=self.config.prioritized is not None)
        agent.set_epsilon(self.epsilon_at(0))

    def _check_network(self, online: nn.Module) -> None:
        if not isinstance(online, QMlp):
            return
        # The support is float32: compare the ends as the network holds them.
        want = {k: float(np.float32(v)) if isinstance(v, float) else v for k, v in self.config.agent_options().items()}
        have: dict[str, Any] = {"dueling": online.dueling, "n_atoms": online.n_atoms}
        if online.n_atoms > 1:
            support = online.support
            assert isinstance(support, torch.Tensor)
            have.update(v_min=float(support[0]), v_max=float(support[-1]))
        if have != {"n_atoms": 1, **want}:
            raise ConfigError(
                f"DQN: the config asks for a Q-network with {want} but the agent's has {have}; "
                "build the agent with DqnAgent(spaces, **config.agent_options())"
            )

    def epsilon_at(self, itr: int) -> float:
        cfg = self.config
        progress = min(1.0, itr / (cfg.exploration_fraction * self.n_itr))
        return cfg.eps_initial + (cfg.eps_final - cfg.eps_initial) * progress

    def beta_at(self, itr: int) -> float:
        """Prioritized replay's importance-weight exponent: beta0 annealed linearly to 1 over the run."""
        per = self.config.prioritized
        return 1.0 if per is None else per.beta0 + (1.0 - per.beta0) * min(1.0, itr / self.n_itr)

    def _explore(self, itr: int) -> dict[str, float]:
        assert self.agent is not None
        epsilon = self.epsilon_at(itr + 1)
        self.agent.set_epsilon(epsilon)
        self.beta = self.beta_at(itr + 1)
        metrics = {"charts/epsilon": epsilon}
        if self.config.prioritized is not None:
            metrics["charts/per_beta"] = self.beta
        return metrics

    def _updates(self, n: int) -> dict[str, float]:
        stats = np.array([self._update() for _ in range(n)])
        return {
            "losses/td": float(stats[:, 0].mean()),
            "losses/q_mean": float(stats[:, 1].mean()),
            "losses/grad_norm": float(stats[:, 2].mean()),
        }

    def _sample(self) -> tuple[dict[str, torch.Tensor], tuple[np.ndarray, np.ndarray] | None]:
        """A minibatch as tensors, and the slots it came from (index, serial) when priorities
        must be updated."""
        assert self.replay is not None
        cfg = self.config
        if isinstance(self.replay, PrioritizedReplayBuffer):
            arrays = self.replay.sample(cfg.batch_size, self._rng, cfg.n_step, cfg.gamma, beta=self.beta)
            slots = (arrays.pop("index"), arrays.pop("serial"))
        else:
            arrays, slots = self.replay.sample(cfg.batch_size, self._rng, cfg.n_step, cfg.gamma), None
        return {k: torch.as_tensor(v, device=self.device) for k, v in arrays.items()}, slots

    def _update(self) -> tuple[float, float, float]:
        assert self.agent is not None and self.replay is not None and self.optimizer is not None
        assert self.target is not None
        cfg, model = self.config, self.agent.model
        batch, slots = self._sample()
        action_B = batch["action"].long()
        out = model(batch["observation"])
        if cfg.categorical is not None:
            target_B_K = categorical_target(batch, model, self.target, cfg.double)
            logits_B_K = out[torch.arange(len(action_B), device=self.device), action_B]
            per_sample_B = -(target_B_K * torch.log_softmax(logits_B_K, dim=-1)).sum(dim=-1)
            error_B = per_sample_B.detach()
            q_B = _q(model, out.detach()).gather(-1, action_B.unsqueeze(-1)).squeeze(-1)
        else:
            y_B = td_target(batch, model, self.target, cfg.gamma, cfg.double)
            q_B = out.gather(-1, action_B.unsqueeze(-1)).squeeze(-1)
            loss_fn = F.smooth_l1_loss if cfg.loss == "huber" else F.mse_loss
            per_sample_B = loss_fn(q_B, y_B, reduction="none")
            error_B = (q_B - y_B).detach().abs()
        loss = (batch["weight"] * per_sample_B).mean() if "weight" in batch else per_sample_B.mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        self.optimizer.step()
        if slots is not None and cfg.prioritized is not None:
            assert isinstance(self.replay, PrioritizedReplayBuffer)
            per = cfg.prioritized
            self.replay.update_priorities(slots[0], (to_numpy(error_B.double()) + per.eps) ** per.alpha, slots[1])
        self.update_count += 1
        if self.update_count % cfg.target_update_interval == 0:
            self.target.load_state_dict(unwrap_model(model).state_dict())
        return float(loss.detach()), float(q_B.detach().mean()), float(grad_norm)

    # ----- snapshots ------------------------------------------------------------------------
    def _variant(self) -> dict[str, Any]:
        """What a snapshot must match: the network's and the replay's kind."""
        return {**self.config.agent_options(), "prioritized": self.config.prioritized is not None}

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None or self.target is None or self.replay is None:
            raise RlplexError("DQN.state_dict called before initialize()")
        return {
            "optimizer": self.optimizer.state_dict(),
            "target": {k: v.clone() for k, v in self.target.state_dict().items()},
            "update_count": self.update_count,
            "rng": self._rng.bit_generator.state,
            "replay": self.replay.state_dict(include_data=self.config.snapshot_replay),
            "variant": self._variant(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.optimizer is None or self.target is None or self.replay is None:
            raise RlplexError("DQN.load_state_dict called before initialize()")
        if "target" not in state or "update_count" not in state:
            raise SnapshotError(f"not a DQN snapshot: its algorithm state holds {sorted(state)}")
        saved = state.get("variant", {"dueling": False, "prioritized": False})
        if saved != self._variant():
            raise SnapshotError(f"the snapshot is of a DQN with {saved}, this config asks for {self._variant()}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.target.load_state_dict(state["target"])
        self.update_count = int(state["update_count"])
        self._rng.bit_generator.state = state["rng"]
        self.replay.load_state_dict(state["replay"])
