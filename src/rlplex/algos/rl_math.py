"""The RL arithmetic every trainer shares: the clipped surrogate, GAE and group advantages.

PPO, A2C, GRPO on the dataflow, and the multi-run trainer all call these; none keeps a copy.
Torch and numpy only (no agents, no models), so any layer may import it.

`clipped_surrogate` is PPO's objective at two granularities:
- `level="token"`: one ratio per element (PPO's per-sample ratio, GRPO's per-token one);
- `level="sequence"`: one ratio per row, exp(mean of the row's masked log-ratios) (GSPO), so a
  long completion is clipped as a whole rather than token by token.
With `proximal_logp` (token level) it is AReaL's decoupled objective: the ratio is taken against the
proximal policy and the behaviour policy (`old_logp`, the one that sampled) only re-weights
by proximal/behaviour, zeroed past `behav_imp_weight_cap`.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np
import torch

from rlplex.errors import RlplexError


class Surrogate(NamedTuple):
    """`clipped_surrogate`'s result; `loss` is to be minimised, the rest carries no gradient."""

    # -min(r A, clip(r) A) [* behaviour weight], per element (token) or per row (sequence); 0 off the mask
    loss: torch.Tensor
    ratio: torch.Tensor  # r, the shape of `loss`
    log_ratio: torch.Tensor  # log r, the shape of `loss`
    behav_weight: torch.Tensor | None  # proximal/behaviour per token, 0 where capped; None without a proximal policy


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    clip: float,
    *,
    mask: torch.Tensor | None = None,
    level: Literal["token", "sequence"] = "token",
    proximal_logp: torch.Tensor | None = None,
    behav_imp_weight_cap: float | torch.Tensor | None = None,
) -> Surrogate:
    """PPO's clipped surrogate of log-probs `logp` (with gradient) against `old_logp`.

    Shapes: `logp`, `old_logp`, `mask`, `proximal_logp` alike, [N] or [B, L]; `adv` [N] or
    [B] (one advantage per row, broadcast over its tokens). Positions off `mask` get loss 0
    through `where`, not a product: a padded position's log-prob may be anything, and 0 * inf
    is NaN. Reduce `loss` as the trainer needs (`masked_mean`, a per-row sum, a plain mean).
    `behav_imp_weight_cap`: a number, or a tensor that broadcasts against `logp` (one cap per row).
    """
    if level not in ("token", "sequence"):
        raise RlplexError(f"clipped_surrogate: level must be 'token' or 'sequence', got {level!r}")
    if level == "sequence" and (mask is None or logp.dim() != 2 or proximal_logp is not None):
        raise RlplexError(
            "clipped_surrogate: level='sequence' needs [B, L] log-probs and a mask, and no proximal policy"
        )
    anchor = old_logp if proximal_logp is None else proximal_logp
    log_ratio = logp - anchor
    if mask is not None:
        log_ratio = torch.where(mask, log_ratio, 0.0)
    if logp.dim() == adv.dim() + 1:
        adv = adv.unsqueeze(-1)
    if level == "sequence":
        assert mask is not None
        log_ratio = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)
        adv = adv.squeeze(-1)
    ratio = log_ratio.exp()
    loss = -torch.minimum(ratio * adv, ratio.clamp(1.0 - clip, 1.0 + clip) * adv)
    weight: torch.Tensor | None = None
    if proximal_logp is not None:
        with torch.no_grad():
            weight = (proximal_logp - old_logp).exp()
            if behav_imp_weight_cap is not None:
                weight = torch.where(weight > behav_imp_weight_cap, 0.0, weight)
            if mask is not None:
                weight = torch.where(mask, weight, 0.0)
        loss = loss * weight
    if mask is not None and level == "token":
        loss = torch.where(mask, loss, 0.0)
    return Surrogate(loss, ratio.detach(), log_ratio.detach(), weight)


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over the positions of `mask` (over all without one); 0 for an empty mask."""
    if mask is None:
        return values.mean()
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)


def ratio_stats(
    ratio: torch.Tensor, log_ratio: torch.Tensor, clip: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(approximate KL (r - 1) - log r, fraction with |r - 1| > clip), as tensors (no `.item()`:
    PPO reduces them once per update, not per minibatch)."""
    approx_kl = masked_mean((ratio - 1) - log_ratio, mask)
    clipfrac = masked_mean(((ratio - 1).abs() > clip).to(ratio.dtype), mask)
    return approx_kl, clipfrac


def gae(
    reward: np.ndarray,
    value: np.ndarray,
    next_value: np.ndarray,
    terminated: np.ndarray,
    truncated: np.ndarray,
    gamma: float,
    lam: float,
) -> np.ndarray:
    """GAE over [T, B] arrays. `next_value[t]` is V(next_observation[t]), so a time-limit
    truncation bootstraps and only a termination zeroes it; either end cuts the trace."""
    not_terminal = 1.0 - terminated.astype(np.float32)
    not_done = 1.0 - (terminated | truncated).astype(np.float32)
    delta = reward + gamma * next_value * not_terminal - value
    advantage = np.zeros_like(reward, dtype=np.float32)
    running = np.zeros(reward.shape[1:], dtype=np.float32)
    for t in range(reward.shape[0] - 1, -1, -1):
        running = delta[t] + gamma * lam * not_done[t] * running
        advantage[t] = running
    return advantage


def value_rescale(x: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    """R2D2's h(x) = sign(x) (sqrt(|x| + 1) - 1) + eps x: squashes large returns so that one
    network fits values of very different scales."""
    return torch.sign(x) * (torch.sqrt(x.abs() + 1.0) - 1.0) + eps * x


def inverse_value_rescale(x: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    """h^-1(x) = sign(x) (((sqrt(1 + 4 eps (|x| + 1 + eps)) - 1) / (2 eps))^2 - 1), the exact
    inverse of `value_rescale`."""
    root = (torch.sqrt(1.0 + 4.0 * eps * (x.abs() + 1.0 + eps)) - 1.0) / (2.0 * eps)
    return torch.sign(x) * (root.pow(2) - 1.0)


def group_advantages(rewards: torch.Tensor, groups: int | torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean of its group) / (population std of its group + eps).

    `groups`: an int, the size of consecutive groups (rewards laid out group after group), or
    a tensor of group ids, one per reward, in any order and of any sizes. A group of one gets
    advantage 0. The whole batch as one group is `groups=len(rewards)`.
    """
    rewards = rewards.float()
    if isinstance(groups, int):
        if groups < 1 or rewards.numel() % groups:
            raise RlplexError(f"group_advantages: {rewards.numel()} rewards do not split into groups of {groups}")
        grouped = rewards.view(-1, groups)
        mean = grouped.mean(dim=1, keepdim=True)
        std = grouped.std(dim=1, keepdim=True, unbiased=False)
        return ((grouped - mean) / (std + eps)).view(-1)
    if groups.shape != rewards.shape:
        raise RlplexError(f"group_advantages: {tuple(groups.shape)} group ids for {tuple(rewards.shape)} rewards")
    _, index = torch.unique(groups, return_inverse=True)
    n_groups = int(index.max()) + 1 if index.numel() else 0
    count = torch.zeros(n_groups, device=rewards.device).index_add_(0, index, torch.ones_like(rewards))
    mean = torch.zeros(n_groups, device=rewards.device).index_add_(0, index, rewards) / count
    centred = rewards - mean[index]
    std = (torch.zeros(n_groups, device=rewards.device).index_add_(0, index, centred * centred) / count).sqrt()
    return centred / (std[index] + eps)
