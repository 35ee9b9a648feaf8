"""rl_math against hand-computed values: the clipped surrogate (token and sequence level,
masked, decoupled with a capped behaviour weight), GAE and group advantages."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlplex.algos.rl_math import clipped_surrogate, gae, group_advantages, masked_mean, ratio_stats
from rlplex.errors import RlplexError

LOG = math.log


def test_token_surrogate_takes_the_pessimistic_branch_per_element() -> None:
    # ratios 1.5, 0.5, 1.1, 0.7 with advantages +1, +1, -2, -1 and clip 0.2:
    #  r=1.5, A=+1: min(1.5, 1.2) = 1.2 (clipped)    r=0.5, A=+1: min(0.5, 0.8) = 0.5
    #  r=1.1, A=-2: min(-2.2, -2.2) = -2.2           r=0.7, A=-1: min(-0.7, -0.8) = -0.8 (clipped)
    old = torch.zeros(4)
    logp = torch.tensor([LOG(1.5), LOG(0.5), LOG(1.1), LOG(0.7)], requires_grad=True)
    out = clipped_surrogate(logp, old, torch.tensor([1.0, 1.0, -2.0, -1.0]), 0.2)
    torch.testing.assert_close(out.loss, torch.tensor([-1.2, -0.5, 2.2, 0.8]))
    torch.testing.assert_close(out.ratio, torch.tensor([1.5, 0.5, 1.1, 0.7]))
    out.loss.sum().backward()
    assert logp.grad is not None
    # Clipped elements carry no gradient; the others d(-r A)/d log r = -r A.
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -0.5, 2.2, 0.0]))
    approx_kl, clipfrac = ratio_stats(out.ratio, out.log_ratio, 0.2)
    assert float(clipfrac) == pytest.approx(0.75)  # |r - 1| > 0.2 for 1.5, 0.5, 0.7
    expected_kl = np.mean([r - 1 - math.log(r) for r in (1.5, 0.5, 1.1, 0.7)])
    assert float(approx_kl) == pytest.approx(expected_kl, rel=1e-5)


def test_token_surrogate_broadcasts_row_advantages_and_ignores_masked_positions() -> None:
    logp = torch.tensor([[LOG(1.1), -math.inf], [LOG(0.9), LOG(2.0)]])  # -inf: padding that would be NaN
    old = torch.zeros(2, 2)
    mask = torch.tensor([[True, False], [True, True]])
    out = clipped_surrogate(logp, old, torch.tensor([2.0, -1.0]), 0.2, mask=mask)
    # row 0: -min(2.2, 2.2); row 1: -min(-0.9, -0.9) = 0.9 and r=2 with A=-1: -min(-2, -1.2) = 2.
    torch.testing.assert_close(out.loss, torch.tensor([[-2.2, 0.0], [0.9, 2.0]]))
    assert float(masked_mean(out.loss, mask)) == pytest.approx((-2.2 + 0.9 + 2.0) / 3)
    _, clipfrac = ratio_stats(out.ratio, out.log_ratio, 0.2, mask)
    assert float(clipfrac) == pytest.approx(1 / 3)


def test_sequence_surrogate_clips_each_row_on_its_mean_log_ratio() -> None:
    # Row 0: log ratios log 2 and 0 -> sequence ratio sqrt 2 = 1.414, clipped to 1.2 with A = 1.
    # Row 1: one token (the other masked), ratio 0.9, A = 1: unclipped.
    logp = torch.tensor([[LOG(2.0), 0.0], [LOG(0.9), 5.0]], requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    out = clipped_surrogate(logp, torch.zeros(2, 2), torch.ones(2), 0.2, mask=mask, level="sequence")
    torch.testing.assert_close(out.ratio, torch.tensor([math.sqrt(2.0), 0.9]))
    torch.testing.assert_close(out.loss, torch.tensor([-1.2, -0.9]))
    out.loss.sum().backward()
    assert logp.grad is not None
    # Row 1: d(-exp(mean log r))/d logp_0 = -0.9 (its only token); row 0 clipped: no gradient.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0], [-0.9, 0.0]]))
    with pytest.raises(RlplexError, match="level='sequence' needs"):
        clipped_surrogate(logp, torch.zeros(2, 2), torch.ones(2), 0.2, level="sequence")


def test_decoupled_surrogate_clips_against_the_proximal_policy_and_caps_the_behaviour_weight() -> None:
    logp = torch.zeros(1, 3, requires_grad=True)  # the trainer still at the proximal policy
    proximal = torch.zeros(1, 3)
    behaviour = torch.tensor([[0.0, -3.0, -0.1]])  # behaviour weights 1, e^3 (past the cap 5), e^0.1
    out = clipped_surrogate(logp, behaviour, torch.ones(1), 0.2, proximal_logp=proximal, behav_imp_weight_cap=5.0)
    assert out.behav_weight is not None
    torch.testing.assert_close(out.behav_weight, torch.tensor([[1.0, 0.0, math.exp(0.1)]]))
    torch.testing.assert_close(out.ratio, torch.ones(1, 3))  # against the proximal policy, not the behaviour one
    torch.testing.assert_close(out.loss, torch.tensor([[-1.0, 0.0, -math.exp(0.1)]]))


def test_gae_bootstraps_through_truncation_but_not_termination() -> None:
    gamma, lam = 0.5, 0.5
    # env 0: t=1 is truncated (time limit: bootstrap with V(next_obs)=2), t=2 terminated (no bootstrap).
    # env 1: no episode end, so the last step bootstraps with next_value 2.
    reward = np.array([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]], dtype=np.float32)
    value = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]], dtype=np.float32)
    next_value = np.array([[1.0, 0.0], [2.0, 0.0], [4.0, 2.0]], dtype=np.float32)
    terminated = np.array([[False, False], [False, False], [True, False]])
    truncated = np.array([[False, False], [True, False], [False, False]])

    adv = gae(reward, value, next_value, terminated, truncated, gamma, lam)

    # env 0: deltas 1+0.5*1-1=0.5, 1+0.5*2-1=1.0, 1+0-1=0; the truncation cuts the trace at t=1.
    # env 1: deltas 1, 1, 1+0.5*2=2; A2=2, A1=1+0.25*2, A0=1+0.25*1.5.
    expected = np.array([[0.5 + 0.25 * 1.0, 1.375], [1.0, 1.5], [0.0, 2.0]], dtype=np.float32)
    np.testing.assert_allclose(adv, expected, rtol=1e-6)


def test_gae_with_lambda_one_and_no_dones_is_discounted_return_minus_value() -> None:
    rng = np.random.default_rng(0)
    reward = rng.normal(size=(5, 1)).astype(np.float32)
    value = rng.normal(size=(5, 1)).astype(np.float32)
    next_value = np.zeros((5, 1), dtype=np.float32)
    next_value[:-1] = value[1:]
    next_value[-1] = 0.7
    no = np.zeros((5, 1), dtype=bool)
    adv = gae(reward, value, next_value, no, no, gamma=0.9, lam=1.0)
    ret = 0.7
    for t in range(4, -1, -1):
        ret = reward[t, 0] + 0.9 * ret
        np.testing.assert_allclose(adv[t, 0], ret - value[t, 0], rtol=1e-5)


def test_group_advantages_by_size_and_by_ids() -> None:
    # Groups of two laid out one after the other: (1, 0) -> (+1, -1); (0.5, 0.5) -> (0, 0).
    by_size = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), 2)
    torch.testing.assert_close(by_size, torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-5, rtol=0)
    # The same by ids, interleaved and of unequal sizes: group 7 = (3, 1, 2): mean 2, std sqrt(2/3);
    # group 4 = (5,): a group of one gets 0.
    rewards = torch.tensor([3.0, 5.0, 1.0, 2.0])
    ids = torch.tensor([7, 4, 7, 7])
    std = math.sqrt(2 / 3)
    expected = torch.tensor([1 / std, 0.0, -1 / std, 0.0])
    torch.testing.assert_close(group_advantages(rewards, ids), expected, atol=1e-5, rtol=0)
    with pytest.raises(RlplexError, match="do not split into groups of 3"):
        group_advantages(rewards, 3)
