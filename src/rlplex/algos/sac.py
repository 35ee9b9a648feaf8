"""SAC: twin Q critics with polyak-averaged targets, a tanh-squashed Gaussian actor and
automatic entropy tuning (SB3's and CleanRL's formulation).

Reads top to bottom: `optimize_agent` stores the new samples (the selection that
`sampler_to_buffer` makes, which AsyncRl's copier processes call too), switches the agent
from uniform random actions to its policy once `learning_starts` transitions are stored,
then does `updates_per_itr` gradient steps. One step, in `_update`:

  1. the critics, towards r + gamma (min_i Q'_i(s', a') - alpha log pi(a'|s')), a' ~ pi(s');
  2. the actor, towards max min_i Q_i(s, a) - alpha log pi(a|s), a ~ pi(s) reparameterised,
     through the updated critics; and the temperature alpha, towards the target entropy
     (-dim(A) by default), both from one backward pass;
  3. the target critics, by polyak averaging.

Alpha is the same in all of them, its value before the step (as SB3, which steps alpha
first but uses the value it had before): so stepping alpha last changes nothing.

The actor is the agent's model (all a sampler needs); the critics, their targets, the
optimizers, log alpha and every random stream of the update live here and in `state_dict`,
so a run resumed from a snapshot continues exactly.
"""

from __future__ import annotations

import copy
import math
from typing import Annotated, Any, Literal

import numpy as np
import torch
from pydantic import Field

from rlplex.agents.sac import SacAgent
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


class SACConfig(StrictModel):
    learning_rate: float = Field(3e-4, gt=0, description="of the actor, the critics and the temperature")
    buffer_size: int = Field(1_000_000, ge=1, description="replay capacity, in transitions")
    batch_size: int = Field(256, ge=1, description="transitions per gradient step")
    learning_starts: int = Field(100, ge=0, description="transitions (uniform random actions) before updates start")
    updates_per_itr: int = Field(1, ge=0, description="gradient steps per sampler batch")
    gamma: float = Field(0.99, ge=0, le=1, description="discount factor")
    tau: float = Field(0.005, gt=0, le=1, description="polyak coefficient of the target critics")
    target_update_interval: int = Field(1, ge=1, description="gradient steps between target updates")
    critic_hidden: tuple[int, ...] = Field(
        (256, 256), description="hidden layer widths of each of the two critics (the actor's: agent.hidden)"
    )
    ent_coef: Annotated[float, Field(gt=0)] | Literal["auto"] = Field("auto", description="alpha, or 'auto' to tune it")
    init_ent_coef: float = Field(1.0, gt=0, description="alpha's start value when ent_coef = 'auto'")
    target_entropy: float | None = Field(None, description="default -dim(A)")
    snapshot_replay: bool = Field(True, description="put the replay buffer in snapshots (exact resume)")


class SAC(ReplayAlgo):
    name = "SAC"

    def __init__(self, config: SACConfig | None = None, seed: int = 0) -> None:
        self.config = config or SACConfig()
        self.seed = seed
        self.agent: SacAgent | None = None
        self.replay: UniformReplayBuffer | None = None
        self.update_count = 0
        self._rng = np.random.default_rng(seed)  # replay sampling
        self._generator = torch.Generator().manual_seed(seed)  # critic init and the update's action noise

    def initialize(self, agent: Any, n_itr: int, world_size: int = 1, shared_replay: bool = False) -> None:
        """`shared_replay` puts the replay buffer in shared memory (AsyncRl's copiers write into it)."""
        if not isinstance(agent, SacAgent):
            raise RlplexError(f"SAC needs a SacAgent, got {type(agent).__name__}")
        cfg = self.config
        self.agent = agent
        actor = agent.actor
        self.device = device = model_device(actor)
        obs_dim, action_dim = int(np.prod(agent.spaces.obs_shape)), actor.action_dim
        # Drawn on the CPU, then moved: the same initial critics on every device.
        self.critic = QEnsemble(obs_dim, action_dim, cfg.critic_hidden, n=2, generator=self._generator).to(device)
        self._generator = update_generator(self.seed, device, self._generator)
        self.critic_target = copy.deepcopy(self.critic).requires_grad_(False)
        # fused: one kernel per step instead of a Python loop over parameters (see PPO).
        # Listed once: Module.parameters() walks the module tree on every call.
        self._actor_params: list[torch.Tensor] = list(actor.parameters())
        self._critic_params = list(self.critic.parameters())
        self._target_params = list(self.critic_target.parameters())
        self.actor_optimizer = adam(self._actor_params, lr=cfg.learning_rate)
        self.critic_optimizer = adam(self._critic_params, lr=cfg.learning_rate)
        auto = cfg.ent_coef == "auto"
        start = cfg.init_ent_coef if auto else float(cfg.ent_coef)
        self.log_alpha = torch.tensor(math.log(start), requires_grad=auto, device=device)
        self.alpha_optimizer = adam([self.log_alpha], lr=cfg.learning_rate) if auto else None
        self.target_entropy = -float(action_dim) if cfg.target_entropy is None else cfg.target_entropy
        self._make_replay(agent, shared_replay)
        agent.set_random_actions(cfg.learning_starts > 0)

    def _explore(self, itr: int) -> dict[str, float]:
        assert self.agent is not None and self.replay is not None
        self.agent.set_random_actions(self.replay.total_appended < self.config.learning_starts)
        return {}

    def _updates(self, n: int) -> dict[str, float]:
        # Kept as tensors and reduced once: an .item() per update costs as much as a small op.
        stats = torch.stack([self._update() for _ in range(n)]).mean(0).tolist()
        names = ("losses/critic", "losses/actor", "losses/alpha", "charts/alpha", "losses/q_mean", "losses/entropy")
        return dict(zip(names, stats, strict=True))

    def _update(self) -> torch.Tensor:
        assert self.agent is not None and self.replay is not None
        cfg, actor = self.config, self.agent.actor
        batch = sample_tensors(self.replay, cfg.batch_size, self._rng, self.device)
        obs, next_obs = batch["observation"], batch["next_observation"]

        pi_action, log_prob = actor.sample(obs, self._generator)
        alpha = self.log_alpha.detach().exp()

        # 1. critics
        with torch.no_grad():
            next_action, next_log_prob = actor.sample(next_obs, self._generator)
            next_q = self.critic_target(next_obs, next_action).min(0).values - alpha * next_log_prob
            target_q = batch["reward"] + cfg.gamma * (1.0 - batch["terminated"].float()) * next_q
        q = self.critic(obs, actor.to_normalized(batch["action"]))
        critic_loss = 0.5 * (q - target_q).pow(2).mean(1).sum()
        self.critic_optimizer.zero_grad(set_to_none=True)
        critic_loss.backward()
        self.critic_optimizer.step()

        # 2. actor, through the updated critics, and temperature. The two losses share no
        # parameter (alpha and log_prob are detached where they meet), so one backward of
        # their sum gives each its own gradient; it asks for the actor's and log alpha's
        # gradients only (a full backward would also fill the critics', for nothing).
        actor_loss = (alpha * log_prob - self.critic(obs, pi_action).min(0).values).mean()
        params = self._actor_params
        alpha_loss = torch.zeros((), device=self.device)
        if self.alpha_optimizer is not None:
            alpha_loss = -(self.log_alpha * (log_prob.detach() + self.target_entropy)).mean()
            params = [*params, self.log_alpha]
        for p, grad in zip(params, torch.autograd.grad(actor_loss + alpha_loss, params), strict=True):
            p.grad = grad
        self.actor_optimizer.step()
        if self.alpha_optimizer is not None:
            self.alpha_optimizer.step()

        # 3. targets
        self.update_count += 1
        if self.update_count % cfg.target_update_interval == 0:
            polyak_update(self._target_params, self._critic_params, cfg.tau)
        entropy = -log_prob.detach().mean()
        return torch.stack(
            (critic_loss.detach(), actor_loss.detach(), alpha_loss.detach(), alpha, q.detach().mean(), entropy)
        )

    def state_dict(self) -> dict[str, Any]:
        if self.replay is None:
            raise RlplexError("SAC.state_dict called before initialize()")
        return {
            "critic": {k: v.clone() for k, v in self.critic.state_dict().items()},
            "critic_target": {k: v.clone() for k, v in self.critic_target.state_dict().items()},
            "actor_optimizer": self.actor_optimizer.state_dict(),
            "critic_optimizer": self.critic_optimizer.state_dict(),
            "log_alpha": self.log_alpha.detach().clone(),
            "alpha_optimizer": None if self.alpha_optimizer is None else self.alpha_optimizer.state_dict(),
            "update_count": self.update_count,
            "rng": self._rng.bit_generator.state,
            "generator": self._generator.get_state(),
            "replay": self.replay.state_dict(include_data=self.config.snapshot_replay),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.replay is None:
            raise RlplexError("SAC.load_state_dict called before initialize()")
        self.critic.load_state_dict(state["critic"])
        self.critic_target.load_state_dict(state["critic_target"])
        self.actor_optimizer.load_state_dict(state["actor_optimizer"])
        self.critic_optimizer.load_state_dict(state["critic_optimizer"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        if self.alpha_optimizer is not None:
            self.alpha_optimizer.load_state_dict(state["alpha_optimizer"])
        self.update_count = int(state["update_count"])
        self._rng.bit_generator.state = state["rng"]
        load_generator_state(self._generator, state["generator"], "SAC")
        self.replay.load_state_dict(state["replay"])
