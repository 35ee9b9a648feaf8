"""GRPO for language models: group-relative advantages and a clipped token-level objective.

`grpo_loss` optionally takes a proximal policy's log-probs (the decoupled PPO objective of
AReaL): the ratio is taken against the proximal policy (the trainer's weights before this
step) and the behaviour policy (the one that sampled, up to eta versions older) only
re-weights, so stale rollouts stay usable without the clip trusting a stale anchor. Tokens
whose behaviour importance weight exceeds `behav_imp_weight_cap` get weight 0, as AReaL
does: a few tokens the sampler found very unlikely must not dominate the update.
"""

from __future__ import annotations

import torch


def group_advantages(rewards_G: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps), for rewards laid out group after group."""
    grouped = rewards_G.view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True, unbiased=False)
    return ((grouped - mean) / (std + eps)).view(-1)


def grpo_loss(
    logprobs_B_L: torch.Tensor,
    old_logprobs_B_L: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_B_L: torch.Tensor,
    clip: float = 0.2,
    proximal_logprobs_B_L: torch.Tensor | None = None,
    behav_imp_weight_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean over completion tokens of the clipped surrogate; returns (loss, stats).

    The loss is normalised by this batch's own token count, so that a run's update does not
    depend on what else shares the trainer batch.
    """
    mask = mask_B_L.float()
    anchor = old_logprobs_B_L if proximal_logprobs_B_L is None else proximal_logprobs_B_L
    ratio = torch.exp(logprobs_B_L - anchor)
    adv = advantages_B[:, None]
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    tokens = mask.sum().clamp(min=1.0)
    stats: dict[str, float] = {}
    if proximal_logprobs_B_L is not None:
        with torch.no_grad():
            # Importance weight of the proximal policy against the behaviour one (no gradient).
            weight = torch.exp(proximal_logprobs_B_L - old_logprobs_B_L)
            no_cap = torch.zeros_like(weight, dtype=torch.bool)
            capped = weight > behav_imp_weight_cap if behav_imp_weight_cap is not None else no_cap
            stats["losses/behav_imp_weight"] = float((weight * mask).sum() / tokens)
            stats["losses/behav_approx_kl"] = float((((weight - 1) - torch.log(weight)) * mask).sum() / tokens)
            stats["losses/behav_capped_frac"] = float((capped.float() * mask).sum() / tokens)
        surrogate = surrogate * torch.where(capped, 0.0, weight)
    loss = -(surrogate * mask).sum() / tokens
    with torch.no_grad():
        clipped = (((ratio - 1).abs() > clip).float() * mask).sum() / tokens
        approx_kl = (((ratio - 1) - torch.log(ratio)) * mask).sum() / tokens
    return loss, {"losses/clipfrac": float(clipped), "losses/approx_kl": float(approx_kl), **stats}
