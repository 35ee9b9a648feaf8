"""TD3 (twin critics, target policy smoothing, delayed actor updates), and DDPG as its
configuration: one critic, no smoothing, no delay (`DDPGConfig`), as SB3 defines it.

Reads top to bottom: `optimize_agent` stores the new samples (the selection that
`sampler_to_buffer` makes, which AsyncRl's copier processes call too), switches the agent
from uniform random actions to its noisy policy once `learning_starts` transitions are
stored, then does `updates_per_itr` gradient steps. One step, in `_update`:

  1. the critics, towards r + gamma min_i Q'_i(s', clip(mu'(s') + clip(noise))) ;
  2. every `policy_delay` steps: the actor, towards max Q_1(s, mu(s)), then the target
     actor and target critics by polyak averaging.

The actor is the agent's model (all a sampler needs, with the exploration noise as a
buffer); the critics, both targets, the optimizers and every random stream of the update
live here and in `state_dict`, so a run resumed from a snapshot continues exactly.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
from pydantic import Field

from rlplex.agents.ddpg import DdpgAgent
from rlplex.algos.off_policy import (
    ReplayAlgo,
    load_generator_state,
    polyak_update,
    sample_tensors,
    update_generator,
)
from rlplex.algos.optim_state import adam
from rlplex.config import StrictModel
from rlplex.errors import RlplexError
from rlplex.models.continuous import QEnsemble
from rlplex.models.device import model_device
from rlplex.replays import UniformReplayBuffer


class TD3Config(StrictModel):
    learning_rate: float = Field(1e-3, gt=0, description="of the actor and the critics")
    buffer_size: int = Field(1_000_000, ge=1, description="replay capacity, in transitions")
    batch_size: int = Field(256, ge=1, description="transitions per gradient step")
    learning_starts: int = Field(100, ge=0, description="transitions (uniform random actions) before updates start")
    updates_per_itr: int = Field(1, ge=0, description="gradient steps per sampler batch")
    gamma: float = Field(0.99, ge=0, le=1, description="discount factor")
    tau: float = Field(0.005, gt=0, le=1, description="polyak coefficient of the target networks")
    critic_hidden: tuple[int, ...] = Field(
        (400, 300), description="hidden layer widths of each critic (the actor's: agent.hidden)"
    )
    n_critics: int = Field(2, ge=1, description="the target takes the minimum over them")
    policy_delay: int = Field(2, ge=1, description="critic updates per actor (and target) update")
    target_policy_noise: float = Field(0.2, ge=0, description="std of the target action's noise (normalised units)")
    target_noise_clip: float = Field(0.5, ge=0, description="the target action's noise is clipped to +-this")
    exploration_noise: float = Field(0.1, ge=0, description="std of the acting noise (normalised units)")
    snapshot_replay: bool = Field(True, description="put the replay buffer in snapshots (exact resume)")


class DDPGConfig(TD3Config):
    """DDPG: TD3 with one critic, no target policy smoothing and no delay."""

    n_critics: int = Field(1, ge=1, description="the target takes the minimum over them")
    policy_delay: int = Field(1, ge=1, description="critic updates per actor (and target) update")
    target_policy_noise: float = Field(
        0.0, ge=0, description="std of the target action's noise (normalised units); 0: none"
    )
    target_noise_clip: float = Field(0.0, ge=0, description="the target action's noise is clipped to +-this")


class TD3(ReplayAlgo):
    name = "TD3"

    def __init__(self, config: TD3Config | None = None, seed: int = 0) -> None:
        self.config = config or TD3Config()
        self.seed = seed
        self.agent: DdpgAgent | None = None
        self.replay: UniformReplayBuffer | None = None
        self.update_count = 0
        self._rng = np.random.default_rng(seed)  # replay sampling
        self._generator = torch.Generator().manual_seed(seed)  # critic init and the target noise

    def initialize(self, agent: Any, n_itr: int, world_size: int = 1, shared_replay: bool = False) -> None:
        """`shared_replay` puts the replay buffer in shared memory (AsyncRl's copiers write into it)."""
        if not isinstance(agent, DdpgAgent):
            raise RlplexError(f"TD3/DDPG needs a DdpgAgent, got {type(agent).__name__}")
        cfg = self.config
        self.agent = agent
        actor = agent.actor
        actor.exploration_noise.fill_(cfg.exploration_noise)
        self.device = device = model_device(actor)
        obs_dim, action_dim = int(np.prod(agent.spaces.obs_shape)), actor.action_dim
        # Drawn on the CPU, then moved: the same initial critics on every device.
        critic = QEnsemble(obs_dim, action_dim, cfg.critic_hidden, n=cfg.n_critics, generator=self._generator)
        self.critic = critic.to(device)
        self._generator = update_generator(self.seed, device, self._generator)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        self.actor_target = copy.deepcopy(actor).requires_grad_(False)
        # fused: one kernel per step instead of a Python loop over parameters (see PPO).
        self.actor_optimizer = adam(actor.parameters(), lr=cfg.learning_rate)
        self.critic_optimizer = adam(self.critic.parameters(), lr=cfg.learning_rate)
        self._make_replay(agent, shared_replay)
        agent.set_random_actions(cfg.learning_starts > 0)

    def _explore(self, itr: int) -> dict[str, float]:
        assert self.agent is not None and self.replay is not None
        self.agent.set_random_actions(self.replay.total_appended < self.config.learning_starts)
        return {}

    def _updates(self, n: int) -> dict[str, float]:
        metrics: dict[str, float] = {}
        critic_stats, actor_losses = [], []
        for _ in range(n):
            critic_loss, q_mean, actor_loss = self._update()
            critic_stats.append(torch.stack((critic_loss, q_mean)))
            if actor_loss is not None:
                actor_losses.append(actor_loss)
        # Kept as tensors and reduced once: an .item() per update costs as much as a small op.
        metrics["losses/critic"], metrics["losses/q_mean"] = torch.stack(critic_stats).mean(0).tolist()
        if actor_losses:
            metrics["losses/actor"] = float(torch.stack(actor_losses).mean())
        return metrics

    def _update(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        assert self.agent is not None and self.replay is not None
        cfg, actor = self.config, self.agent.actor
        batch = sample_tensors(self.replay, cfg.batch_size, self._rng, self.device)
        obs, next_obs = batch["observation"], batch["next_observation"]

        # 1. critics
        with torch.no_grad():
            next_action = self.actor_target(next_obs)
            if cfg.target_policy_noise > 0:
                noise = torch.randn(next_action.shape, generator=self._generator, device=self.device)
                noise = noise * cfg.target_policy_noise
                next_action = (next_action + noise.clamp(-cfg.target_noise_clip, cfg.target_noise_clip)).clamp(-1, 1)
            next_q = self.critic_target(next_obs, next_action).min(0).values
            target_q = batch["reward"] + cfg.gamma * (1.0 - batch["terminated"].float()) * next_q
        q = self.critic(obs, actor.to_normalized(batch["action"]))
        critic_loss = (q - target_q).pow(2).mean(1).sum()
        self.critic_optimizer.zero_grad(set_to_none=True)
        critic_loss.backward()
        self.critic_optimizer.step()
        self.update_count += 1
        if self.update_count % cfg.policy_delay != 0:
            return critic_loss.detach(), q.detach().mean(), None

        # 2. actor through the first critic; gradients for the actor's parameters only (a full
        # backward would also fill the critics' weight gradients, for nothing). Then targets.
        actor_loss = -self.critic(obs, actor(obs), first=1).mean()
        params = list(actor.parameters())
        for p, grad in zip(params, torch.autograd.grad(actor_loss, params), strict=True):
            p.grad = grad
        self.actor_optimizer.step()
        polyak_update(self.critic_target.parameters(), self.critic.parameters(), cfg.tau)
        polyak_update(self.actor_target.parameters(), actor.parameters(), cfg.tau)
        return critic_loss.detach(), q.detach().mean(), actor_loss.detach()

    def state_dict(self) -> dict[str, Any]:
        if self.replay is None:
            raise RlplexError("TD3.state_dict called before initialize()")
        return {
            "critic": {k: v.clone() for k, v in self.critic.state_dict().items()},
            "critic_target": {k: v.clone() for k, v in self.critic_target.state_dict().items()},
            "actor_target": {k: v.clone() for k, v in self.actor_target.state_dict().items()},
            "actor_optimizer": self.actor_optimizer.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict(),
            "update_count": self.update_count,
            "rng": self._rng.bit_generator.state,
            "generator": self._generator.get_state(),
            "replay": self.replay.state_dict(include_data=self.config.snapshot_replay),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.replay is None:
            raise RlplexError("TD3.load_state_dict called before initialize()")
        self.critic.load_state_dict(state["critic"])
        self.critic_target.load_state_dict(state["critic_target"])
        self.actor_target.load_state_dict(state["actor_target"])
        self.actor_optimizer.load_state_dict(state["actor_optimizer"])
        self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        self.update_count = int(state["update_count"])
        self._rng.bit_generator.state = state["rng"]
        load_generator_state(self._generator, state["generator"], "TD3")
        self.replay.load_state_dict(state["replay"])
