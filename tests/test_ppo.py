from __future__ import annotations

import numpy as np
import pytest
import torch

from rlplex.algos.ppo import _clip_grad_norm, gae_advantages
from rlplex.models import ActorCriticMlp, QMlp


def test_gae_bootstraps_through_truncation_but_not_termination() -> None:
    gamma, lam = 0.5, 0.5
    # env 0: t=1 is truncated (time limit: bootstrap with V(next_obs)=2), t=2 terminated (no bootstrap).
    # env 1: no episode end, so the last step bootstraps with next_value 2.
    reward = np.array([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]], dtype=np.float32)
    value = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]], dtype=np.float32)
    next_value = np.array([[1.0, 0.0], [2.0, 0.0], [4.0, 2.0]], dtype=np.float32)
    terminated = np.array([[False, False], [False, False], [True, False]])
    truncated = np.array([[False, False], [True, False], [False, False]])

    adv = gae_advantages(reward, value, next_value, terminated, truncated, gamma, lam)

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
    adv = gae_advantages(reward, value, next_value, no, no, gamma=0.9, lam=1.0)
    ret = 0.7
    for t in range(4, -1, -1):
        ret = reward[t, 0] + 0.9 * ret
        np.testing.assert_allclose(adv[t, 0], ret - value[t, 0], rtol=1e-5)


def test_clip_grad_norm_equals_torch_clip_grad_norm() -> None:
    torch.manual_seed(0)
    model = ActorCriticMlp(4, 2)
    out, value = model(torch.randn(32, 4))
    (out.pow(2).sum() * 100 + value.sum()).backward()  # a gradient norm well above the limit
    params = list(model.parameters())
    grads = [p.grad.clone() for p in params if p.grad is not None]
    expected = [g.clone() for g in grads]
    reference = [torch.nn.Parameter(torch.zeros_like(g)) for g in expected]
    for p, g in zip(reference, expected, strict=True):
        p.grad = g
    torch.nn.utils.clip_grad_norm_(reference, 0.5, foreach=True)
    _clip_grad_norm(params, 0.5)
    assert float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) > 0.5
    for p, r in zip(params, reference, strict=True):
        assert torch.equal(p.grad, r.grad)


@pytest.mark.parametrize("model", [ActorCriticMlp(4, 3), QMlp(4, 3)])
def test_functional_mlp_forward_equals_module_calls(model: torch.nn.Module) -> None:
    x = torch.randn(16, 4)
    ours = model(x)
    if isinstance(model, ActorCriticMlp):
        assert torch.equal(ours[0], model.pi(x)) and torch.equal(ours[1], model.v(x).squeeze(-1))
    else:
        assert torch.equal(ours, model.q(x))
