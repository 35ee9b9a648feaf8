"""Optimizer state by parameter name: one flat tensor and one tensor per parameter load each other."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlplex.algos.optim_state import load_named_optimizer_state, named_optimizer_state
from rlplex.errors import SnapshotError


def stepped(model: nn.Module, flat: bool, steps: int = 3) -> torch.optim.Adam:
    """Adam over `model`, through one flat tensor whose views are the parameters (as PPO's
    closed-form update does) or over the parameters themselves; a few steps taken."""
    params = list(model.parameters())
    if flat:
        whole = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in params]))
        offset = 0
        for p in params:
            p.data = whole.data[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        params = [whole]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    for i in range(steps):
        for p in params:
            p.grad = torch.full_like(p, 0.1 * (i + 1)) + torch.arange(p.numel()).view_as(p) * 0.01
        optimizer.step()
    return optimizer


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


@pytest.mark.parametrize("source_flat", [True, False], ids=["flat-to-per-parameter", "per-parameter-to-flat"])
def test_state_moves_between_a_flat_tensor_and_per_parameter_tensors(source_flat: bool) -> None:
    source_model, target_model = net(), net()
    saved = named_optimizer_state(stepped(source_model, source_flat), source_model)
    target = stepped(target_model, not source_flat, steps=0)
    load_named_optimizer_state(target, target_model, saved)
    # Round trip through the target's layout gives back every parameter's state.
    again = named_optimizer_state(target, target_model)
    assert set(again["state"]) == {name for name, _ in source_model.named_parameters()}
    for name, values in saved["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(again["state"][name][key], values[key]), (name, key)


def test_state_of_other_parameters_is_refused_naming_both_sides() -> None:
    model = net()
    saved = named_optimizer_state(stepped(model, True), model)
    other = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    with pytest.raises(
        SnapshotError, match=r"only in the snapshot \[\].*only in this run's model \['1.bias', '1.weight'\]"
    ):
        load_named_optimizer_state(stepped(other, False, steps=0), other, saved)
    # An older positional state of another layout: a SnapshotError, not Adam's bare ValueError.
    positional = stepped(net(), True).state_dict()
    with pytest.raises(SnapshotError, match="does not fit this run's optimizer"):
        load_named_optimizer_state(stepped(net(), False, steps=0), net(), positional)
