"""The rollout format: what an orchestrator writes to `rollouts/step_N` and the trainer reads.

```
rollouts/step_N/
    rollouts.safetensors   tokens (int64 [n, L]), attention (int64 [n, L], 1 on real tokens),
                           loss_mask (bool [n, L], True on generated tokens), logprobs (float32
                           [n, L], sampling-policy log-probs, 0 off the mask), advantages
                           (float32 [n]), rewards (float32 [n])
    meta.json              {"run_id", "step", "policy_step", "n"}
    STABLE                 written last: the step is complete
```

Prompts are left-padded (see `rlplex.models.lm`). The files cross a trust boundary (any
process that can write the run directory), so they are safetensors and JSON, never pickle,
and `read_rollouts` checks every shape, dtype and value before the trainer touches them: a
malformed step raises `MalformedRolloutError` with the reason, which the trainer turns into an
eviction of that run alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from rlplex.errors import MultiRunError
from rlplex.io.safe_files import read_regular_file, write_file_atomic
from rlplex.multirun.rundir import STABLE_MARKER, RunDir

ROLLOUT_FILE = "rollouts.safetensors"
META_FILE = "meta.json"
MAX_ROLLOUT_BYTES = 256 * 1024 * 1024

_DTYPES = {
    "tokens": torch.int64,
    "attention": torch.int64,
    "loss_mask": torch.bool,
    "logprobs": torch.float32,
    "advantages": torch.float32,
    "rewards": torch.float32,
}
_PER_TOKEN = ("tokens", "attention", "loss_mask", "logprobs")


class MalformedRolloutError(MultiRunError):
    """A run's rollout step cannot be trained on; the message names the file and what is wrong."""


@dataclass
class RolloutBatch:
    """One run's rollouts for one step, validated."""

    run_id: str
    step: int
    policy_step: int  # the broadcast step whose adapter generated them
    tokens: torch.Tensor
    attention: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_tokens(self) -> int:
        """Tokens that carry loss: what fair packing counts."""
        return int(self.loss_mask.sum())

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in _DTYPES}


def write_rollouts(run: RunDir, batch: RolloutBatch) -> Path:
    """Write `batch` to `rollouts/step_N` atomically (files, then the STABLE marker)."""
    validate(batch, f"{run.rollout_step(batch.step)}")
    directory = run.ensure_dir("rollouts", run.rollout_step(batch.step).name)
    tensors = {name: tensor.contiguous() for name, tensor in batch.tensors().items()}
    write_file_atomic(directory / ROLLOUT_FILE, save_safetensors(tensors))
    meta = {"run_id": batch.run_id, "step": batch.step, "policy_step": batch.policy_step, "n": batch.n}
    write_file_atomic(directory / META_FILE, json.dumps(meta).encode())
    write_file_atomic(directory / STABLE_MARKER, b"")
    return directory


def rollouts_ready(run: RunDir, step: int) -> bool:
    return (run.rollout_step(step) / STABLE_MARKER).is_file()


def read_rollouts(run: RunDir, step: int, vocab_size: int | None = None) -> RolloutBatch:
    """Load and validate `rollouts/step_N`; `MalformedRolloutError` names the file and the fault."""
    directory = run.rollout_step(step)
    path = directory / ROLLOUT_FILE
    meta = _read_meta(directory / META_FILE, run.run_id, step, run.root)
    try:
        # A FIFO, a link to a device or a step folder linked out of the run is refused unread.
        tensors = load_safetensors(read_regular_file(path, MAX_ROLLOUT_BYTES, within=run.root))
    except (OSError, SafetensorError) as error:
        raise MalformedRolloutError(f"{path}: unreadable rollouts ({error})") from None
    missing = sorted(set(_DTYPES) - set(tensors))
    if missing:
        raise MalformedRolloutError(f"{path}: missing tensors {missing}")
    batch = RolloutBatch(run.run_id, step, meta["policy_step"], **{name: tensors[name] for name in _DTYPES})
    validate(batch, str(path), vocab_size)
    if batch.n != meta["n"]:
        raise MalformedRolloutError(f"{path}: meta.json says n={meta['n']} but the tensors hold {batch.n} rows")
    return batch


def _read_meta(path: Path, run_id: str, step: int, root: Path) -> dict[str, Any]:
    try:
        meta = json.loads(read_regular_file(path, within=root))
    except (OSError, ValueError) as error:
        raise MalformedRolloutError(f"{path}: unreadable meta ({error})") from None
    if not isinstance(meta, dict):
        raise MalformedRolloutError(f"{path}: expected a JSON object, got {type(meta).__name__}")
    for field, kind in (("step", int), ("policy_step", int), ("n", int)):
        if not isinstance(meta.get(field), kind) or isinstance(meta.get(field), bool):
            raise MalformedRolloutError(f"{path}: field {field!r} must be an integer, got {meta.get(field)!r}")
    if meta["step"] != step or meta.get("run_id") != run_id:
        raise MalformedRolloutError(
            f"{path}: written for run {meta.get('run_id')!r} step {meta['step']}, read as run {run_id!r} step {step}"
        )
    return dict(meta)


def validate(batch: RolloutBatch, source: str, vocab_size: int | None = None) -> None:
    """Raise `MalformedRolloutError` unless every tensor has the dtype, shape and values a step needs."""
    for name, dtype in _DTYPES.items():
        tensor = getattr(batch, name)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype:
            found = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise MalformedRolloutError(f"{source}: {name} must be {dtype}, got {found}")
    if batch.tokens.dim() != 2 or batch.tokens.shape[0] == 0 or batch.tokens.shape[1] < 2:
        raise MalformedRolloutError(f"{source}: tokens must be [n >= 1, L >= 2], got {list(batch.tokens.shape)}")
    shape = batch.tokens.shape
    for name in _PER_TOKEN:
        if getattr(batch, name).shape != shape:
            shape_found = list(getattr(batch, name).shape)
            raise MalformedRolloutError(f"{source}: {name} has shape {shape_found}, tokens {list(shape)}")
    for name in ("advantages", "rewards"):
        if getattr(batch, name).shape != shape[:1]:
            shape_found = list(getattr(batch, name).shape)
            raise MalformedRolloutError(f"{source}: {name} has shape {shape_found}, expected [{shape[0]}]")
    for name in ("logprobs", "advantages", "rewards"):
        tensor = getattr(batch, name)
        if not bool(torch.isfinite(tensor).all()):
            raise MalformedRolloutError(f"{source}: {name} holds NaN or infinite values")
    if not bool(batch.loss_mask.any()):
        raise MalformedRolloutError(f"{source}: loss_mask selects no token: nothing to learn from")
    if bool((batch.loss_mask & (batch.attention == 0)).any()):
        raise MalformedRolloutError(f"{source}: loss_mask selects padding tokens")
    low, high = int(batch.tokens.min()), int(batch.tokens.max())
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        raise MalformedRolloutError(f"{source}: token ids span [{low}, {high}], outside the vocabulary of {vocab_size}")
    if batch.logprobs.masked_select(batch.loss_mask).max() > 1e-4:
        raise MalformedRolloutError(f"{source}: logprobs must be <= 0 on generated tokens")
