"""A2C: synchronous advantage actor-critic over a [T, B] batch from any sampler.

Reads top to bottom: GAE advantages and returns (shared with PPO, bootstrapping through
time-limit truncations), then ONE gradient step on the whole batch of
-adv log pi(a|s) + value_coef * value loss - entropy_coef * entropy. No ratio and no
clipping: that is what separates it from PPO, whose agents and samplers it uses as they are.
RMSprop (alpha 0.99, eps 1e-5) by default, as SB3 and the original paper.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field

from rlplex.agents.pg import PgAgent
from rlplex.algos.optim_state import adam, load_named_optimizer_state, named_optimizer_state
from rlplex.algos.pg_batch import advantages_and_returns, clip_grad_norm
from rlplex.config import StrictModel
from rlplex.errors import RlplexError
from rlplex.samplers.batch import SampleBatch


class A2CConfig(StrictModel):
    learning_rate: float = Field(7e-4, gt=0, description="the optimizer's step size")
    lr_schedule: Literal["constant", "linear"] = Field(
        "constant", description="linear: the learning rate decays to 0 over runner.schedule_steps"
    )
    optimizer: Literal["rmsprop", "adam"] = Field(
        "rmsprop", description="rmsprop (alpha 0.99, eps 1e-5, as SB3) or adam (eps 1e-5)"
    )
    gamma: float = Field(0.99, ge=0, le=1, description="discount factor")
    gae_lambda: float = Field(1.0, ge=0, le=1, description="1.0: plain n-step advantages")
    # rlplex halves the squared error in the value loss: 1.0 weighs it as SB3's vf_coef 0.5 does.
    value_coef: float = Field(1.0, ge=0, description="weight of the value loss (half the squared error)")
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus; 0: none")
    max_grad_norm: float = Field(0.5, gt=0, description="gradients are clipped to this global norm")
    normalize_advantage: bool = Field(False, description="advantages to zero mean and unit std in each batch")


class A2C:
    def __init__(self, config: A2CConfig | None = None) -> None:
        self.config = config or A2CConfig()
        self.agent: PgAgent | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.n_itr = 1
        self.update_count = 0

    def initialize(self, agent: Any, n_itr: int, world_size: int = 1) -> None:
        if not isinstance(agent, PgAgent):
            raise RlplexError(f"A2C needs a policy-gradient agent, got {type(agent).__name__}")
        cfg = self.config
        self.agent = agent
        self.n_itr = max(1, n_itr)
        params = agent.model.parameters()
        if cfg.optimizer == "rmsprop":
            self.optimizer = torch.optim.RMSprop(params, lr=cfg.learning_rate, alpha=0.99, eps=1e-5)
        else:
            self.optimizer = adam(params, lr=cfg.learning_rate, eps=1e-5)

    def optimize_agent(self, itr: int, samples: SampleBatch | None) -> dict[str, float]:
        if self.agent is None or self.optimizer is None:
            raise RlplexError("A2C.optimize_agent called before initialize()")
        if samples is None:
            raise RlplexError("A2C is on-policy and needs a sample batch every iteration")
        cfg, agent = self.config, self.agent
        lr = cfg.learning_rate * (max(0.0, 1.0 - itr / self.n_itr) if cfg.lr_schedule == "linear" else 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        advantage, returns = advantages_and_returns(agent, samples, cfg.gamma, cfg.gae_lambda)
        # Single steps for a feed-forward agent, whole environment sequences for a recurrent one.
        batch = agent.training_batch(samples, advantage=advantage, returns=returns)
        adv = batch["advantage"]
        if cfg.normalize_advantage and adv.numel() > 1:
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)

        log_prob, entropy, value = agent.evaluate_batch(batch)
        policy_loss = -(adv * log_prob).mean()
        value_loss = 0.5 * (value - batch["returns"]).pow(2).mean()
        entropy_mean = entropy.mean()
        loss = policy_loss + cfg.value_coef * value_loss - cfg.entropy_coef * entropy_mean
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        clip_grad_norm([p for p in agent.model.parameters() if p.requires_grad], cfg.max_grad_norm)
        self.optimizer.step()
        self.update_count += 1
        policy, value_l, ent = torch.stack((policy_loss, value_loss, entropy_mean)).tolist()
        return {"losses/policy": policy, "losses/value": value_l, "losses/entropy": ent, "charts/learning_rate": lr}

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            raise RlplexError("A2C.state_dict called before initialize()")
        assert self.agent is not None
        # By parameter name: the optimizer's tensors differ between runners (see optim_state).
        optimizer = named_optimizer_state(self.optimizer, self.agent.model)
        return {"optimizer": optimizer, "update_count": self.update_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.optimizer is None:
            raise RlplexError("A2C.load_state_dict called before initialize()")
        assert self.agent is not None
        load_named_optimizer_state(self.optimizer, self.agent.model, state["optimizer"])
        self.update_count = int(state["update_count"])
