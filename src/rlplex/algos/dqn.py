"""DQN with a replay buffer, a target network and (by default) the double-DQN target.

Reads top to bottom: `optimize_agent` stores the new samples (the selection that
`sampler_to_buffer` makes, which AsyncRl's copier processes call too), sets epsilon for
the next batch, then does `updates_per_itr` gradient steps on uniform minibatches.

Epsilon follows the iteration index, so it is a pure function of progress: after resuming
from a snapshot it continues where it was (rlpyt restarted it at 1). It lives in the
model's `epsilon` buffer, so it reaches sampler processes with the weights.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from rlplex.agents.dqn import DqnAgent
from rlplex.algos.off_policy import ReplayAlgo
from rlplex.config import StrictModel
from rlplex.errors import RlplexError
from rlplex.models import unwrap_model
from rlplex.replays import UniformReplayBuffer


class DQNConfig(StrictModel):
    learning_rate: float = Field(2.3e-3, gt=0)
    buffer_size: int = Field(100_000, ge=1)
    batch_size: int = Field(64, ge=1, description="transitions per gradient step")
    learning_starts: int = Field(1000, ge=0, description="transitions in the replay before the first update")
    # In gradient steps. rl-zoo's "10" is in env steps and SB3 copies only while collecting,
    # i.e. once per train call: with 128 updates per call that is every 128 updates.
    target_update_interval: int = Field(128, ge=1, description="gradient steps between target-network copies")
    updates_per_itr: int = Field(128, ge=0, description="gradient steps per sampler batch (the train frequency)")
    gamma: float = Field(0.99, ge=0, le=1)
    double_dqn: bool = True
    loss: Literal["huber", "mse"] = "huber"
    max_grad_norm: float = Field(10.0, gt=0)
    exploration_fraction: float = Field(0.16, gt=0, le=1, description="share of the run over which epsilon decays")
    eps_initial: float = Field(1.0, ge=0, le=1)
    eps_final: float = Field(0.04, ge=0, le=1)
    snapshot_replay: bool = Field(True, description="put the replay buffer in snapshots (exact resume)")


def td_target(
    batch: dict[str, torch.Tensor], online: nn.Module, target: nn.Module, gamma: float, double_dqn: bool
) -> torch.Tensor:
    """r + gamma * Q_target(s', a') for non-terminal s', a' = argmax of the online (double) or target net."""
    with torch.no_grad():
        next_q_B_A = target(batch["next_observation"])
        if double_dqn:
            next_action_B = online(batch["next_observation"]).argmax(dim=-1, keepdim=True)
            next_value_B = next_q_B_A.gather(-1, next_action_B).squeeze(-1)
        else:
            next_value_B = next_q_B_A.max(dim=-1).values
        not_terminal_B = 1.0 - batch["terminated"].float()
        target_B: torch.Tensor = batch["reward"] + gamma * not_terminal_B * next_value_B
        return target_B


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
        self._rng = np.random.default_rng(seed)

    def initialize(self, agent: Any, n_itr: int, world_size: int = 1, shared_replay: bool = False) -> None:
        """`shared_replay` puts the replay buffer in shared memory (AsyncRl's copiers write into it)."""
        if not isinstance(agent, DqnAgent):
            raise RlplexError(f"DQN needs a DqnAgent, got {type(agent).__name__}")
        self.agent = agent
        self.n_itr = max(1, n_itr)
        online = unwrap_model(agent.model)
        self.target = copy.deepcopy(online)
        self.target.requires_grad_(False)
        self.optimizer = torch.optim.Adam(agent.model.parameters(), lr=self.config.learning_rate)
        self._make_replay(agent, shared_replay)
        agent.set_epsilon(self.epsilon_at(0))

    def epsilon_at(self, itr: int) -> float:
        cfg = self.config
        progress = min(1.0, itr / (cfg.exploration_fraction * self.n_itr))
        return cfg.eps_initial + (cfg.eps_final - cfg.eps_initial) * progress

    def _explore(self, itr: int) -> dict[str, float]:
        assert self.agent is not None
        epsilon = self.epsilon_at(itr + 1)
        self.agent.set_epsilon(epsilon)
        return {"charts/epsilon": epsilon}

    def _updates(self, n: int) -> dict[str, float]:
        stats = np.array([self._update() for _ in range(n)])
        return {
            "losses/td": float(stats[:, 0].mean()),
            "losses/q_mean": float(stats[:, 1].mean()),
            "losses/grad_norm": float(stats[:, 2].mean()),
        }

    def _update(self) -> tuple[float, float, float]:
        assert self.agent is not None and self.replay is not None and self.optimizer is not None
        assert self.target is not None
        cfg = self.config
        batch = {k: torch.as_tensor(v) for k, v in self.replay.sample(cfg.batch_size, self._rng).items()}
        y_B = td_target(batch, self.agent.model, self.target, cfg.gamma, cfg.double_dqn)
        q_B = self.agent.model(batch["observation"]).gather(-1, batch["action"].long().unsqueeze(-1)).squeeze(-1)
        loss = F.smooth_l1_loss(q_B, y_B) if cfg.loss == "huber" else F.mse_loss(q_B, y_B)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.agent.model.parameters(), cfg.max_grad_norm)
        self.optimizer.step()
        self.update_count += 1
        if self.update_count % cfg.target_update_interval == 0:
            self.target.load_state_dict(unwrap_model(self.agent.model).state_dict())
        return float(loss.detach()), float(q_B.detach().mean()), float(grad_norm)

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None or self.target is None or self.replay is None:
            raise RlplexError("DQN.state_dict called before initialize()")
        return {
            "optimizer": self.optimizer.state_dict(),
            "target": {k: v.clone() for k, v in self.target.state_dict().items()},
            "update_count": self.update_count,
            "rng": self._rng.bit_generator.state,
            "replay": self.replay.state_dict(include_data=self.config.snapshot_replay),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.optimizer is None or self.target is None or self.replay is None:
            raise RlplexError("DQN.load_state_dict called before initialize()")
        self.optimizer.load_state_dict(state["optimizer"])
        self.target.load_state_dict(state["target"])
        self.update_count = int(state["update_count"])
        self._rng.bit_generator.state = state["rng"]
        self.replay.load_state_dict(state["replay"])
