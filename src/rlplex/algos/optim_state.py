"""Optimizer state keyed by parameter name, so that a snapshot loads whatever tensors the
optimizer holds now.

torch numbers an optimizer's tensors by position. The same model can be optimized through
different tensors: PPO's closed-form update gives Adam one flat tensor whose views are the
module's parameters, while under `SyncRl` (DDP, autograd) Adam holds one tensor per parameter.
A positional state dict of one layout cannot load into the other (Adam raises a bare
`ValueError`). Here the state is written per named module parameter, the flat tensor's state
cut at its views, and rebuilt for the optimizer's layout when loaded.

State values shaped like their tensor (Adam's moments) are cut and joined; the others
(`step`) are shared by every piece of a tensor, so they are copied.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class _Piece:
    """A named module parameter inside one optimizer tensor, at `offset` elements."""

    name: str
    offset: int
    shape: tuple[int, ...]
    whole: bool  # the optimizer tensor is this parameter itself


def _pieces(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[list[_Piece]]:
    """For each optimizer tensor, in state-dict order: the named parameters it holds."""
    named = list(unwrap_model(model).named_parameters())
    found: list[list[_Piece]] = []
    for group in optimizer.param_groups:
        for tensor in group["params"]:
            pieces = [_Piece(name, 0, tuple(p.shape), True) for name, p in named if p is tensor]
            if not pieces:
                storage = tensor.untyped_storage().data_ptr()
                pieces = sorted(
                    (
                        _Piece(name, (p.data_ptr() - tensor.data_ptr()) // p.element_size(), tuple(p.shape), False)
                        for name, p in named
                        if p.untyped_storage().data_ptr() == storage
                    ),
                    key=lambda piece: piece.offset,
                )
            if not pieces:  # not a module parameter (a temperature, say): known by position only
                pieces = [_Piece(f"#{len(found)}", 0, tuple(tensor.shape), True)]
            found.append(pieces)
    return found


def _is_elementwise(key: str, value: Any, shape: tuple[int, ...]) -> bool:
    return key != "step" and isinstance(value, torch.Tensor) and tuple(value.shape) == shape


def named_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, Any]:
    """The optimizer's state keyed by the names of `model`'s parameters."""
    saved = optimizer.state_dict()
    pieces = _pieces(optimizer, model)
    sizes = [tuple(t.shape) for g in optimizer.param_groups for t in g["params"]]
    state: dict[str, dict[str, Any]] = {}
    group_of: dict[str, int] = {}
    for group_index, group in enumerate(saved["param_groups"]):
        for index in group["params"]:
            for piece in pieces[index]:
                group_of[piece.name] = group_index
                values = saved["state"].get(index)
                if values is None:  # never stepped
                    continue
                numel = int(torch.Size(piece.shape).numel())
                state[piece.name] = {
                    key: value.detach().clone()
                    if piece.whole or not _is_elementwise(key, value, sizes[index])
                    else value.detach().reshape(-1)[piece.offset : piece.offset + numel].view(piece.shape).clone()
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
    pieces = _pieces(optimizer, model)
    now = {piece.name for tensor_pieces in pieces for piece in tensor_pieces}
    before = set(saved["group_of"])
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
    state: dict[int, dict[str, Any]] = {}
    for index, tensor_pieces in enumerate(pieces):
        stepped = [piece.name in saved["state"] for piece in tensor_pieces]
        if not any(stepped):
            continue
        if not all(stepped):
            raise SnapshotError(f"optimizer state covers only part of a tensor ({tensor_pieces[0].name}, ...)")
        first = saved["state"][tensor_pieces[0].name]
        if len(tensor_pieces) == 1 and tensor_pieces[0].whole:
            state[index] = dict(first)
            continue
        state[index] = {
            key: torch.cat([saved["state"][p.name][key].reshape(-1) for p in tensor_pieces])
            if _is_elementwise(key, value, tensor_pieces[0].shape)
            else value
            for key, value in first.items()
        }
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
