"""PPO with the clipped objective and GAE, over a [T, B] batch from any sampler.

Reads top to bottom: advantages (bootstrapping through time-limit truncations with the
value of `next_observation`), then `n_epochs` passes of shuffled minibatches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from pydantic import Field
from torch.autograd.function import once_differentiable

from rlplex.agents.pg import CategoricalPgAgent, GaussianPgAgent, PgAgent
from rlplex.algos.optim_state import load_named_optimizer_state, named_optimizer_state
from rlplex.algos.pg_batch import advantages_and_returns, clip_grad_norm
from rlplex.config import StrictModel
from rlplex.errors import RlplexError
from rlplex.models import ActorCriticMlp, GaussianActorCriticMlp
from rlplex.samplers.batch import SampleBatch


class PPOConfig(StrictModel):
    learning_rate: float = Field(3e-4, gt=0)
    lr_schedule: Literal["constant", "linear"] = "constant"
    n_epochs: int = Field(10, ge=1)
    minibatch_size: int = Field(64, ge=1, description="samples per gradient step (per rank under SyncRl)")
    gamma: float = Field(0.99, ge=0, le=1)
    gae_lambda: float = Field(0.95, ge=0, le=1)
    clip_range: float = Field(0.2, gt=0)
    clip_schedule: Literal["constant", "linear"] = "constant"
    value_coef: float = Field(0.5, ge=0)
    entropy_coef: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(0.5, gt=0)
    normalize_advantage: bool = True
    target_kl: float | None = Field(None, gt=0, description="stop the epochs early past this approximate KL")


class Minibatch(NamedTuple):
    """One gradient step's samples, flattened over time and environments."""

    observation: torch.Tensor
    action: torch.Tensor
    old_log_prob: torch.Tensor
    advantage: torch.Tensor
    returns: torch.Tensor


def clipped_losses_and_grads(
    log_prob: torch.Tensor, value: torch.Tensor, minibatch: Minibatch, clip: float, value_coef: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate and value losses with their gradients, without autograd.

    Returns (policy_loss + value_coef * value_loss, policy_loss, value_loss, ratio,
    d loss / d log_prob, d loss / d value). The gradients have a closed form:

        d policy_loss / d log_prob = -adv * ratio * [ratio * adv <= clip(ratio) * adv] / n
        d value_loss  / d value    = (value - returns) / n     (value_loss = 0.5 * mean sq. err.)

    which is what autograd gives for the expression (the min's and the clamp's masks).
    """
    n = log_prob.numel()
    ratio = (log_prob - minibatch.old_log_prob).exp()
    unclipped = ratio * minibatch.advantage
    clipped = ratio.clamp(1 - clip, 1 + clip) * minibatch.advantage
    policy_loss = -torch.minimum(unclipped, clipped).mean()
    value_error = value - minibatch.returns
    value_loss = 0.5 * value_error.pow(2).mean()
    loss = policy_loss + value_coef * value_loss
    grad_log_prob = torch.where(unclipped <= clipped, unclipped, 0.0).mul_(-1.0 / n)
    grad_value = value_error.mul_(value_coef / n)
    return loss, policy_loss, value_loss, ratio, grad_log_prob, grad_value


class _ClippedPpoLoss(torch.autograd.Function):
    """`clipped_losses_and_grads` as one autograd node: a dozen elementwise ops on a few
    hundred numbers cost more as autograd nodes than as arithmetic. Outputs: total loss,
    policy loss, value loss, ratio (the last three not differentiable)."""

    @staticmethod
    def forward(
        ctx: Any, log_prob: torch.Tensor, value: torch.Tensor, minibatch: Minibatch, clip: float, value_coef: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        loss, policy_loss, value_loss, ratio, grad_log_prob, grad_value = clipped_losses_and_grads(
            log_prob, value, minibatch, clip, value_coef
        )
        ctx.save_for_backward(grad_log_prob, grad_value)
        ctx.mark_non_differentiable(policy_loss, value_loss, ratio)
        return loss, policy_loss, value_loss, ratio

    @staticmethod
    @once_differentiable  # a second derivative through the written-out backward is not supported
    def backward(ctx: Any, grad_loss: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        grad_log_prob, grad_value = ctx.saved_tensors
        return grad_log_prob * grad_loss, grad_value * grad_loss, None, None, None


def clipped_ppo_loss(
    log_prob: torch.Tensor, value: torch.Tensor, minibatch: Minibatch, clip: float, value_coef: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(policy_loss + value_coef * value_loss, policy_loss, value_loss, ratio), differentiable
    in log_prob and value; see `clipped_losses_and_grads`."""
    loss, policy_loss, value_loss, ratio = _ClippedPpoLoss.apply(log_prob, value, minibatch, clip, value_coef)
    return loss, policy_loss, value_loss, ratio


def _flatten(params: Sequence[torch.nn.Parameter]) -> torch.nn.Parameter:
    """One parameter holding all of `params`, which become views of it: an optimizer stepping
    the flat one updates the module's own. Module code that copies into its parameters
    (`load_state_dict`) keeps working; code that replaces their `.data` would cut the link."""
    flat = torch.nn.Parameter(torch.cat([p.detach().reshape(-1) for p in params]))
    offset = 0
    for p in params:
        p.data = flat.data[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def fused_update_supported(agent: PgAgent) -> bool:
    """Whether PPO can take its gradients without autograd (`ActorCriticMlp.forward_saving`
    and the agent's `distribution_backward`): rlplex's own agents and models, unwrapped (a
    DDP-wrapped model needs autograd's hooks) and with every parameter trained."""
    return (
        type(agent) in (CategoricalPgAgent, GaussianPgAgent)
        and type(agent.model) in (ActorCriticMlp, GaussianActorCriticMlp)
        and all(p.requires_grad for p in agent.model.parameters())
    )


class PPO:
    def __init__(self, config: PPOConfig | None = None) -> None:
        self.config = config or PPOConfig()
        self.agent: PgAgent | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._flat: torch.nn.Parameter | None = None  # the closed-form path's one parameter
        self.n_itr = 1
        self.update_count = 0

    def initialize(self, agent: Any, n_itr: int, world_size: int = 1) -> None:
        if not isinstance(agent, PgAgent):
            raise RlplexError(f"PPO needs a policy-gradient agent, got {type(agent).__name__}")
        self.agent = agent
        self.n_itr = max(1, n_itr)
        # Gradients in closed form when the agent and model are rlplex's own (half the update
        # time of autograd for a CartPole-sized MLP); the same arithmetic up to float rounding.
        # Their parameters then live in one flat tensor, so that clipping and Adam handle one
        # tensor rather than a dozen (a tenth of the update).
        params = list(agent.model.parameters())
        self._flat = _flatten(params) if fused_update_supported(agent) else None
        # fused: Adam's whole step is one kernel instead of a Python loop over parameters (most
        # of the update time for classic-control MLPs on CPU) or several foreach calls; the
        # arithmetic is the same up to float rounding.
        self.optimizer = torch.optim.Adam(
            params if self._flat is None else [self._flat], lr=self.config.learning_rate, eps=1e-5, fused=True
        )

    def _fraction_left(self, itr: int) -> float:
        return max(0.0, 1.0 - itr / self.n_itr)

    def optimize_agent(self, itr: int, samples: SampleBatch | None) -> dict[str, float]:
        if self.agent is None or self.optimizer is None:
            raise RlplexError("PPO.optimize_agent called before initialize()")
        if samples is None:
            raise RlplexError("PPO is on-policy and needs a sample batch every iteration")
        cfg, agent = self.config, self.agent
        lr = cfg.learning_rate * (self._fraction_left(itr) if cfg.lr_schedule == "linear" else 1.0)
        clip = cfg.clip_range * (self._fraction_left(itr) if cfg.clip_schedule == "linear" else 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        T, B = samples.T, samples.B
        obs_shape = samples.observation.shape[2:]
        value = samples.agent_info["value"]
        advantage, returns = advantages_and_returns(agent, samples, cfg.gamma, cfg.gae_lambda)

        n = T * B
        obs = torch.as_tensor(samples.observation.reshape(n, *obs_shape))
        action = torch.as_tensor(samples.action.reshape(n, *samples.action.shape[2:]))
        old_log_prob = torch.as_tensor(samples.agent_info["log_prob"].reshape(n))
        adv_all = torch.as_tensor(advantage.reshape(n))
        ret_all = torch.as_tensor(returns.reshape(n))

        mb = min(cfg.minibatch_size, n)
        # One minibatch of the whole batch (rl-zoo's CartPole setting): shuffling only reorders
        # sums, so skip it and the gathers, and normalise the advantages once, not every epoch.
        whole = mb == n
        if whole and cfg.normalize_advantage and n > 1:
            adv_all = (adv_all - adv_all.mean()) / (adv_all.std() + 1e-8)
        whole_batch = Minibatch(obs, action, old_log_prob, adv_all, ret_all)
        flat = self._flat
        params = [p for p in agent.model.parameters() if p.requires_grad]
        if flat is not None and not all(p.untyped_storage().data_ptr() == flat.data_ptr() for p in params):
            raise RlplexError(
                "the agent's parameters were replaced after PPO.initialize() (a .to(), a "
                "load_state_dict(assign=True) or a new model): PPO would train a stale copy; "
                "call PPO.initialize() again after such a change"
            )
        # Kept as tensors and reduced once at the end: a `.item()` or a few small reductions
        # per minibatch cost about as much as the minibatch's own arithmetic.
        losses: list[torch.Tensor] = []
        ratios: list[torch.Tensor] = []
        log_ratios: list[torch.Tensor] = []
        stop = False
        for _ in range(cfg.n_epochs):
            order = None if whole else torch.randperm(n)
            for start in range(0, n - mb + 1, mb):
                if order is None:
                    minibatch = whole_batch
                else:
                    minibatch = Minibatch(*(tensor[order[start : start + mb]] for tensor in whole_batch))
                    if cfg.normalize_advantage and mb > 1:
                        adv = minibatch.advantage
                        minibatch = minibatch._replace(advantage=(adv - adv.mean()) / (adv.std() + 1e-8))
                if flat is not None:
                    with torch.no_grad():
                        policy_loss, value_loss, entropy_mean, ratio, log_ratio = self._fused_gradients(minibatch, clip)
                        flat.grad = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
                        clip_grad_norm([flat], cfg.max_grad_norm)
                else:
                    self.optimizer.zero_grad(set_to_none=True)
                    policy_loss, value_loss, entropy_mean, ratio, log_ratio = self._autograd_gradients(minibatch, clip)
                    clip_grad_norm(params, cfg.max_grad_norm)
                self.optimizer.step()
                self.update_count += 1
                losses.append(torch.stack((policy_loss, value_loss, entropy_mean)))
                ratios.append(ratio)
                log_ratios.append(log_ratio)
                if cfg.target_kl is not None:
                    approx_kl = ((ratios[-1] - 1) - log_ratios[-1]).mean()
                    if approx_kl.item() > 1.5 * cfg.target_kl:
                        stop = True
                        break
            if stop:
                break
        # Every minibatch has `mb` samples, so the mean over all of them is the mean of the
        # per-minibatch means.
        ratio_all, log_ratio_all = torch.stack(ratios), torch.stack(log_ratios)
        policy_mean, value_mean, entropy_mean_all = torch.stack(losses).mean(0).tolist()
        approx_kl_mean = float(((ratio_all - 1) - log_ratio_all).mean())
        clipfrac_mean = float(((ratio_all - 1).abs() > clip).float().mean())
        explained = 1.0 - float(np.var(returns - value)) / (float(np.var(returns)) + 1e-8)
        return {
            "losses/policy": policy_mean,
            "losses/value": value_mean,
            "losses/entropy": entropy_mean_all,
            "losses/approx_kl": approx_kl_mean,
            "losses/clipfrac": clipfrac_mean,
            "losses/explained_variance": explained,
            "charts/learning_rate": lr,
        }

    def _autograd_gradients(self, minibatch: Minibatch, clip: float) -> tuple[torch.Tensor, ...]:
        """Backpropagates the loss; returns (policy loss, value loss, entropy, ratio, log ratio)."""
        assert self.agent is not None
        cfg = self.config
        log_prob, entropy, value = self.agent.evaluate(minibatch.observation, minibatch.action)
        loss, policy_loss, value_loss, ratio = clipped_ppo_loss(log_prob, value, minibatch, clip, cfg.value_coef)
        if cfg.entropy_coef != 0.0:  # a zero-weighted term would still cost its backward pass
            loss = loss - cfg.entropy_coef * entropy.mean()
        loss.backward()
        return policy_loss, value_loss, entropy.detach().mean(), ratio, log_prob.detach() - minibatch.old_log_prob

    def _fused_gradients(self, minibatch: Minibatch, clip: float) -> tuple[torch.Tensor, ...]:
        """`_autograd_gradients` in closed form (see `fused_update_supported`): sets every
        parameter's `.grad` directly."""
        agent, cfg = self.agent, self.config
        assert agent is not None
        model = agent.model
        assert isinstance(model, ActorCriticMlp)
        out, value, saved = model.forward_saving(minibatch.observation)
        log_prob, entropy = agent.log_prob_entropy(out, minibatch.action)
        _, policy_loss, value_loss, ratio, grad_log_prob, grad_value = clipped_losses_and_grads(
            log_prob, value, minibatch, clip, cfg.value_coef
        )
        grad_out = agent.distribution_backward(
            out, minibatch.action, grad_log_prob, cfg.entropy_coef / log_prob.numel()
        )
        model.backward_into_grads(saved, grad_out, grad_value)
        return policy_loss, value_loss, entropy.mean(), ratio, log_prob - minibatch.old_log_prob

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
