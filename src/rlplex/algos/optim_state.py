"""Optimizer state keyed by parameter name, so that a snapshot loads whatever order the
optimizer holds its tensors in now.

torch numbers an optimizer's tensors by position, and the position of a parameter is the
order in which its algorithm listed them (which a change of model code, a wrapper or a runner
kind can change). Here the state is written per named module parameter and matched by name
when loaded; a tensor that is not a module parameter (a temperature, say) is known by its
position only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from rlplex.errors import SnapshotError
from rlplex.models import unwrap_model

FORMAT = "named-v1"


def adam(params: Iterable[torch.Tensor], lr: float, eps: float = 1e-8) -> torch.optim.Adam:
    """Adam as every rlplex algorithm builds it: fused, so that its whole step is one kernel
    instead of a Python loop over the parameters (most of an update's time for small MLPs on
    the CPU; on CUDA as well); the same arithmetic as the loop, up to rounding."""
    return torch.optim.Adam(params, lr=lr, eps=eps, fused=True)


# Settings of how the optimizer runs, not of the state: the current optimizer's are kept.
_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable", "maximize")


def _names(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    """Each optimizer tensor's name, in state-dict order: its module parameter's, else `#<position>`."""
    by_id = {id(p): name for name, p in unwrap_model(model).named_parameters()}
    tensors = [t for group in optimizer.param_groups for t in group["params"]]
    return [by_id.get(id(t), f"#{i}") for i, t in enumerate(tensors)]


def named_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """The optimizer's state keyed by the names of `model`'s parameters."""
    saved = optimizer.state_dict()
    names = _names(optimizer, model)
    state: dict[str, dict[str, Any]] = {}
    group_of: dict[str, int] = {}
    for group_index, group in enumerate(saved["param_groups"]):
        for index in group["params"]:
            group_of[names[index]] = group_index
            values = saved["state"].get(index)
            if values is not None:  # else never stepped
                state[names[index]] = {
                    key: value.detach().clone() if isinstance(value, torch.Tensor) else value
                    for key, value in values.items()
                }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]
    return {"format": FORMAT, "param_groups": groups, "group_of": group_of, "state": state}


def load_named_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module, saved: dict[str, Any]) -> None:
    """Load `named_optimizer_state`'s output (or an older positional state dict) into `optimizer`.

    A state whose parameters are not the model's is a `SnapshotError` naming the parameters
    only on each side (the runner adds the snapshot's path).
    """
    if saved.get("format") != FORMAT:
        _load_positional(optimizer, saved)
        return
    names = _names(optimizer, model)
    now, before = set(names), set(saved["group_of"])
    if now != before:
        raise SnapshotError(
            f"optimizer state is for other parameters: only in the snapshot {sorted(before - now)[:5]}, "
            f"only in this run's model {sorted(now - before)[:5]}"
        )
    current = optimizer.state_dict()
    if len(current["param_groups"]) != len(saved["param_groups"]):
        raise SnapshotError(
            f"optimizer has {len(saved['param_groups'])} parameter groups in the snapshot, "
            f"{len(current['param_groups'])} in this run"
        )
    state = {index: dict(saved["state"][name]) for index, name in enumerate(names) if name in saved["state"]}
    groups = []
    for group, old in zip(current["param_groups"], saved["param_groups"], strict=True):
        settings = {k: v for k, v in old.items() if k not in _IMPLEMENTATION_KEYS}
        groups.append({**group, **settings, "params": group["params"]})
    _load_positional(optimizer, {"state": state, "param_groups": groups})


def _load_positional(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    try:
        optimizer.load_state_dict(state_dict)
    except (ValueError, KeyError, RuntimeError) as error:
        raise SnapshotError(
            f"optimizer state does not fit this run's optimizer ({error}); a snapshot written by an "
            "older rlplex under another runner kind resumes under that kind only"
        ) from None
