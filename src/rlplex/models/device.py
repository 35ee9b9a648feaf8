"""Where a model lives, and how arrays cross to it and back: the one place every runner,
agent and algorithm asks.

- `resolve_device("auto" | "cpu" | "cuda", field, index)`: auto is CUDA when torch sees a GPU,
  else the CPU; "cuda" without a GPU is a `DeviceError` naming the config field.
- `model_device(model)`: the device of a model's first parameter or buffer (CPU for a model
  with neither, such as `RandomAgent`'s).
- `to_tensor(array, device)`, `to_numpy(tensor)`: what agents and algorithms use at their
  numpy boundary (samplers and replays hold numpy; models hold tensors on their device).

Samplers stay on the CPU: their worker processes build CPU copies of the agent and load its
weights from shared memory (`SharedWeights.write` copies across devices), so only the
learner's model, its batches and what the serial sampler's agent computes live on a GPU.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import numpy as np
import torch
from torch import nn

from rlplex.errors import DeviceError

_CPU = torch.device("cpu")


def resolve_device(device: str, field: str = "device", index: int | None = None) -> torch.device:
    """The torch device a config's `auto`/`cpu`/`cuda` means on this machine.

    `index` picks a GPU (a rank's `local_rank`), modulo the number of GPUs: ranks of one
    machine spread over its GPUs and share them when there are more ranks than GPUs.
    """
    if device == "cpu":
        return _CPU
    if device not in ("auto", "cuda"):
        raise DeviceError(f"field '{field}': {device!r} is not one of 'auto', 'cpu', 'cuda'")
    if torch.cuda.is_available():
        if index is None:  # the process's current GPU
            return torch.device("cuda")
        return torch.device("cuda", index % torch.cuda.device_count())
    if device == "cuda":
        raise DeviceError(
            f"field '{field}': 'cuda' was asked for, but this torch ({torch.__version__}) sees no CUDA device; "
            'use "cpu" or "auto"'
        )
    return _CPU


# A model's first tensor, found once: walking `parameters()` costs about 6 us, a few per cent of
# an acting step of a small MLP. `Module.to` keeps the tensor objects (it swaps their data), so
# the tensor found before a move tells the device after it.
_FIRST_TENSOR: weakref.WeakKeyDictionary[nn.Module, torch.Tensor | None] = weakref.WeakKeyDictionary()


def model_device(model: nn.Module) -> torch.device:
    try:
        tensor = _FIRST_TENSOR[model]
    except KeyError:
        tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
        _FIRST_TENSOR[model] = tensor
    return _CPU if tensor is None else tensor.device


def to_tensor(array: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A numpy array (or tensor) as a tensor on `device`; no copy when it is already there."""
    return torch.as_tensor(array, dtype=dtype, device=device)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's values as a numpy array, wherever the tensor lives (no copy on the CPU)."""
    if tensor.is_cpu and not tensor.requires_grad:  # an acting step's outputs: skip detach's new tensor
        return tensor.numpy()
    array: np.ndarray = tensor.detach().cpu().numpy()
    return array


__all__ = ["model_device", "resolve_device", "to_numpy", "to_tensor"]
