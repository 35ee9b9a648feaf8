"""PPO with the clipped objective and GAE, over a [T, B] batch from any sampler.

Reads top to bottom, as CleanRL's ppo.py: the schedules, GAE advantages and returns
(bootstrapping through time-limit truncations with the value of `next_observation`), then
`n_epochs` passes of shuffled minibatches, each one autograd step on
mean(clipped surrogate) + value_coef * value loss - entropy_coef * entropy. The surrogate,
GAE and the ratio statistics are `rlplex.algos.rl_math`'s, shared with A2C, GRPO and the
multi-run trainer.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from rlplex.agents.pg import PgAgent
from rlplex.algos.optim_state import adam, load_named_optimizer_state, named_optimizer_state
from rlplex.algos.pg_batch import advantages_and_returns, clip_grad_norm
from rlplex.algos.rl_math import clipped_surrogate, ratio_stats
from rlplex.config import StrictModel
from rlplex.errors import RlplexError
from rlplex.samplers.batch import SampleBatch


class PPOConfig(StrictModel):
    learning_rate: float = Field(3e-4, gt=0, description="Adam's step size")
    lr_schedule: Literal["constant", "linear"] = Field(
        "constant", description="linear: the learning rate decays to 0 over runner.schedule_steps"
    )
    n_epochs: int = Field(10, ge=1, description="passes over each sampler batch")
    minibatch_size: int = Field(64, ge=1, description="samples per gradient step (per rank under SyncRl)")
    gamma: float = Field(0.99, ge=0, le=1, description="discount factor")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE's lambda; 1.0: plain n-step advantages")
    clip_range: float = Field(0.2, gt=0, description="the probability ratio is clipped to 1 +- this")
    clip_schedule: Literal["constant", "linear"] = Field(
        "constant", description="linear: clip_range decays to 0 over runner.schedule_steps"
    )
    value_coef: float = Field(0.5, ge=0, description="weight of the value loss (half the squared error)")
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus; 0: none")
    max_grad_norm: float = Field(0.5, gt=0, description="gradients are clipped to this global norm")
    normalize_advantage: bool = Field(True, description="advantages to zero mean and unit std in each minibatch")
    target_kl: float | None = Field(None, gt=0, description="stop the epochs early past this approximate KL")


class PPO:
    def __init__(self, config: PPOConfig | None = None) -> None:
        self.config = config or PPOConfig()
        self.agent: PgAgent | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.params: list[torch.nn.Parameter] = []
        self.n_itr = 1
        self.update_count = 0

    def initialize(self, agent: Any, n_itr: int, world_size: int = 1) -> None:
        if not isinstance(agent, PgAgent):
            raise RlplexError(f"PPO needs a policy-gradient agent, got {type(agent).__name__}")
        self.agent = agent
        self.n_itr = max(1, n_itr)
        self.params = [p for p in agent.model.parameters() if p.requires_grad]
        self.optimizer = adam(self.params, lr=self.config.learning_rate, eps=1e-5)

    def _fraction_left(self, itr: int) -> float:
        return max(0.0, 1.0 - itr / self.n_itr)

    def optimize_agent(self, itr: int, samples: SampleBatch | None) -> dict[str, float]:
        if self.agent is None or self.optimizer is None:
            raise RlplexError("PPO.optimize_agent called before initialize()")
        if samples is None:
            raise RlplexError("PPO is on-policy and needs a sample batch every iteration")
        cfg, agent = self.config, self.agent
        current = [p for p in agent.model.parameters() if p.requires_grad]
        if len(current) != len(self.params) or any(p is not q for p, q in zip(current, self.params, strict=True)):
            raise RlplexError(
                "the agent's parameters were replaced after PPO.initialize() (a .to(), a "
                "load_state_dict(assign=True) or a new model): PPO would train a stale copy; "
                "call PPO.initialize() again after such a change"
            )
        lr = cfg.learning_rate * (self._fraction_left(itr) if cfg.lr_schedule == "linear" else 1.0)
        clip = cfg.clip_range * (self._fraction_left(itr) if cfg.clip_schedule == "linear" else 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        # Advantages and returns, then the batch as tensors whose first axis minibatches draw
        # from: single steps [T * B] for a feed-forward agent, whole environment sequences [B]
        # (each [T] in time order, with its start state) for a recurrent one.
        advantage, returns = advantages_and_returns(agent, samples, cfg.gamma, cfg.gae_lambda)
        batch = agent.training_batch(
            samples, old_log_prob=samples.agent_info["log_prob"], advantage=advantage, returns=returns
        )
        n_units = len(batch["action"])
        steps_per_unit = samples.T * samples.B // n_units
        mb = max(1, min(cfg.minibatch_size // steps_per_unit, n_units))
        # One minibatch of the whole batch (rl-zoo's CartPole setting): shuffling only reorders
        # sums, so skip it and the gathers, and normalise the advantages once, not every epoch.
        whole = mb == n_units
        if whole and cfg.normalize_advantage and batch["advantage"].numel() > 1:
            adv = batch["advantage"]
            batch["advantage"] = (adv - adv.mean()) / (adv.std() + 1e-8)
        # Kept as tensors and reduced once at the end: an `.item()` or a few small reductions
        # per minibatch cost about as much as the minibatch's own arithmetic.
        losses: list[torch.Tensor] = []
        ratios: list[torch.Tensor] = []
        log_ratios: list[torch.Tensor] = []
        stop = False
        for _epoch in range(cfg.n_epochs):
            order = None if whole else torch.randperm(n_units)
            for start in range(0, n_units - mb + 1, mb):
                if order is None:
                    minibatch = batch
                else:
                    idx = order[start : start + mb]
                    minibatch = {k: v[idx] for k, v in batch.items()}
                    if cfg.normalize_advantage and minibatch["advantage"].numel() > 1:
                        adv = minibatch["advantage"]
                        minibatch["advantage"] = (adv - adv.mean()) / (adv.std() + 1e-8)
                mb_log_prob, mb_adv, mb_ret = minibatch["old_log_prob"], minibatch["advantage"], minibatch["returns"]

                self.optimizer.zero_grad(set_to_none=True)
                log_prob, entropy_B, value = agent.evaluate_batch(minibatch)
                surrogate = clipped_surrogate(log_prob, mb_log_prob, mb_adv, clip)
                policy_loss = surrogate.loss.mean()
                value_loss = 0.5 * (value - mb_ret).pow(2).mean()
                entropy = entropy_B.mean()
                loss = policy_loss + cfg.value_coef * value_loss
                if cfg.entropy_coef != 0.0:  # a zero-weighted term would still cost its backward pass
                    loss = loss - cfg.entropy_coef * entropy
                loss.backward()
                clip_grad_norm(self.params, cfg.max_grad_norm)
                self.optimizer.step()
                self.update_count += 1

                losses.append(torch.stack((policy_loss, value_loss, entropy)).detach())
                ratios.append(surrogate.ratio)
                log_ratios.append(surrogate.log_ratio)
                if cfg.target_kl is not None:
                    approx_kl, _ = ratio_stats(surrogate.ratio, surrogate.log_ratio, clip)
                    stop = approx_kl.item() > 1.5 * cfg.target_kl
                    if stop:
                        break
            if stop:
                break

        # Every minibatch has `mb` samples, so the mean over all of them is the mean of the
        # per-minibatch means.
        policy_mean, value_mean, entropy_mean = torch.stack(losses).mean(0).tolist()
        approx_kl_mean, clipfrac_mean = ratio_stats(
            torch.cat([r.flatten() for r in ratios]), torch.cat([r.flatten() for r in log_ratios]), clip
        )
        explained = 1.0 - float(np.var(returns - samples.agent_info["value"])) / (float(np.var(returns)) + 1e-8)
        return {
            "losses/policy": policy_mean,
            "losses/value": value_mean,
            "losses/entropy": entropy_mean,
            "losses/approx_kl": float(approx_kl_mean),
            "losses/clipfrac": float(clipfrac_mean),
            "losses/explained_variance": explained,
            "charts/learning_rate": lr,
        }

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            raise RlplexError("PPO.state_dict called before initialize()")
        assert self.agent is not None
        # By parameter name: the optimizer's tensors differ between runners (see optim_state).
        optimizer = named_optimizer_state(self.optimizer, self.agent.model)
        return {"optimizer": optimizer, "update_count": self.update_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.optimizer is None:
            raise RlplexError("PPO.load_state_dict called before initialize()")
        assert self.agent is not None
        load_named_optimizer_state(self.optimizer, self.agent.model, state["optimizer"])
        self.update_count = int(state["update_count"])
