"""GRPO's loss for language models: `rl_math.clipped_surrogate` per token, averaged over the
completion tokens of the batch, with the statistics GRPO logs.

With `proximal_logprobs_B_L` it is the decoupled PPO objective of AReaL: the ratio is taken
against the proximal policy (the trainer's weights before this step) and the behaviour policy
(the one that sampled, up to eta versions older) only re-weights, so stale rollouts stay
usable without the clip trusting a stale anchor. Tokens whose behaviour importance weight
exceeds `behav_imp_weight_cap` get weight 0, as AReaL does: a few tokens the sampler found
very unlikely must not dominate the update. Group advantages are `rl_math.group_advantages`.
"""

from __future__ import annotations

import torch

from rlplex.algos.rl_math import clipped_surrogate, masked_mean, ratio_stats


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
    mask = mask_B_L.bool()
    surrogate = clipped_surrogate(
        logprobs_B_L,
        old_logprobs_B_L,
        advantages_B,
        clip,
        mask=mask,
        proximal_logp=proximal_logprobs_B_L,
        behav_imp_weight_cap=behav_imp_weight_cap,
    )
    loss = masked_mean(surrogate.loss, mask)
    approx_kl, clipfrac = ratio_stats(surrogate.ratio, surrogate.log_ratio, clip, mask)
    stats = {"losses/clipfrac": float(clipfrac), "losses/approx_kl": float(approx_kl)}
    if proximal_logprobs_B_L is not None:
        with torch.no_grad():
            # Importance weight of the proximal policy against the behaviour one, before the cap.
            log_weight = torch.where(mask, proximal_logprobs_B_L - old_logprobs_B_L, 0.0)
            weight = log_weight.exp()
            capped = weight > behav_imp_weight_cap if behav_imp_weight_cap is not None else torch.zeros_like(mask)
            stats["losses/behav_imp_weight"] = float(masked_mean(weight, mask))
            stats["losses/behav_approx_kl"] = float(masked_mean((weight - 1) - log_weight, mask))
            stats["losses/behav_capped_frac"] = float(masked_mean(capped.float(), mask))
    return loss, stats
