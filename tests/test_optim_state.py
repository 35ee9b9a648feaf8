"""Optimizer state by parameter name: it loads into an optimizer that lists the parameters in another order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlplex.algos.optim_state import load_named_optimizer_state, named_optimizer_state
from rlplex.errors import SnapshotError


def stepped(model: nn.Module, reverse: bool = False, steps: int = 3) -> torch.optim.Adam:
    """Adam over `model`'s parameters (listed backwards with `reverse`), a few steps taken."""
    params = list(model.parameters())[:: -1 if reverse else 1]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    for i in range(steps):
        for p in params:
            p.grad = torch.full_like(p, 0.1 * (i + 1)) + torch.arange(p.numel()).view_as(p) * 0.01
        optimizer.step()
    return optimizer


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def test_state_moves_to_an_optimizer_that_lists_the_parameters_in_another_order() -> None:
    source_model, target_model = net(), net()
    source = stepped(source_model)
    saved = named_optimizer_state(source, source_model)
    target = stepped(target_model, reverse=True, steps=0)
    load_named_optimizer_state(target, target_model, saved)
    targets = dict(target_model.named_parameters())
    for name, p in source_model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(target.state[targets[name]][key], source.state[p][key]), (name, key)
    # By position the two disagree: entry 0 is another parameter in each.
    assert target.state_dict()["state"][0]["exp_avg"].shape != source.state_dict()["state"][0]["exp_avg"].shape


def test_state_of_other_parameters_is_refused_naming_both_sides() -> None:
    model = net()
    saved = named_optimizer_state(stepped(model), model)
    other = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    with pytest.raises(
        SnapshotError, match=r"only in the snapshot \[\].*only in this run's model \['1.bias', '1.weight'\]"
    ):
        load_named_optimizer_state(stepped(other, steps=0), other, saved)
    # An older positional state of another layout: a SnapshotError, not Adam's bare ValueError.
    positional = stepped(net()).state_dict()
    with pytest.raises(SnapshotError, match="does not fit this run's optimizer"):
        load_named_optimizer_state(stepped(other, steps=0), other, positional)
