"""The orchestrator's sampling policy: the shared base model plus one run's broadcast adapter.

A broadcast folder (`broadcast/step_N`, PEFT layout, see `rlplex.multirun.rundir.peft_export`) is read without
peft: `adapter_config.json` gives rank, alpha and target modules, `adapter_model.safetensors`
the ``base_model.model.<module>.lora_{A,B}.weight`` tensors. The base model is wrapped once
with `apply_multi_lora` (one slot, the run's rank) so that generation runs the same
MultiLoRALinear code the trainer trains with; each new broadcast only copies weights into
that slot. Both files come from another process, so everything is checked and every fault is
an `AdapterError` naming the file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from torch import nn

from rlplex.errors import AdapterError
from rlplex.io.safe_files import read_regular_file
from rlplex.multirun.rundir.peft_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX
from rlplex.multirun.trainer.lora_apply import MultiLoRAModules, apply_multi_lora

MAX_ADAPTER_BYTES = 512 * 1024 * 1024
MAX_ADAPTER_CONFIG_BYTES = 1_000_000
_A, _B = ".lora_A.weight", ".lora_B.weight"


class PeftAdapter:
    """One adapter read from a PEFT folder: rank, alpha, targets and per-module A/B tensors."""

    def __init__(self, rank: int, alpha: float, target_modules: list[str], modules: dict[str, dict[str, torch.Tensor]]):
        self.rank, self.alpha, self.target_modules, self.modules = rank, alpha, target_modules, modules


def _read_config(path: Path, within: Path | None) -> tuple[int, float, list[str]]:
    try:
        data: Any = json.loads(read_regular_file(path, MAX_ADAPTER_CONFIG_BYTES, within).decode("utf-8"))
    except (OSError, ValueError) as error:  # UnsafeFileError: a link, a FIFO, too big
        raise AdapterError(f"{path}: unreadable adapter config ({error})") from None
    if not isinstance(data, dict):
        raise AdapterError(f"{path}: expected a JSON object")
    if data.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: field 'peft_type' must be 'LORA', got {data.get('peft_type')!r}")
    rank, alpha, targets = data.get("r"), data.get("lora_alpha"), data.get("target_modules")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{path}: field 'r' must be a positive integer, got {rank!r}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"{path}: field 'lora_alpha' must be a positive number, got {alpha!r}")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise AdapterError(f"{path}: field 'target_modules' must be a non-empty list of names, got {targets!r}")
    return rank, float(alpha), sorted(targets)


def read_peft_adapter(directory: str | Path, within: Path | None = None) -> PeftAdapter:
    """Read and check a PEFT LoRA folder; raise `AdapterError` naming the file and the fault.

    Files that are links are refused, and with `within` so is a folder that leads out of it."""
    directory = Path(directory)
    rank, alpha, targets = _read_config(directory / ADAPTER_CONFIG, within)
    path = directory / ADAPTER_WEIGHTS
    try:
        tensors = load_safetensors(read_regular_file(path, MAX_ADAPTER_BYTES, within))
    except (OSError, SafetensorError) as error:
        raise AdapterError(f"{path}: unreadable adapter weights ({error})") from None
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if not key.startswith(PEFT_PREFIX) or not key.endswith((_A, _B)):
            raise AdapterError(f"{path}: unexpected tensor {key!r} (expected {PEFT_PREFIX}<module>{_A} or {_B})")
        name, part = key[len(PEFT_PREFIX) : -len(_A)], key[-len(_A) + 1 :]
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
            raise AdapterError(f"{path}: {key} must hold finite floating-point values")
        modules.setdefault(name, {})[part] = tensor
    if not modules:
        raise AdapterError(f"{path}: no LoRA tensors")
    for name, pair in modules.items():
        if set(pair) != {"lora_A.weight", "lora_B.weight"}:
            raise AdapterError(f"{path}: module {name!r} lacks lora_A or lora_B")
        a, b = pair["lora_A.weight"], pair["lora_B.weight"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(f"{path}: module {name!r} has A{tuple(a.shape)} B{tuple(b.shape)}, not of rank {rank}")
        if name.rsplit(".", 1)[-1] not in targets:
            raise AdapterError(f"{path}: module {name!r} is not in target_modules {targets}")
    return PeftAdapter(rank, alpha, targets, modules)


class AdapterPolicy:
    """The base model with one MultiLoRA slot holding the latest loaded broadcast adapter."""

    def __init__(self, model: nn.Module, max_rank: int) -> None:
        self.model = model
        self.max_rank = max_rank
        self.lora: MultiLoRAModules | None = None
        self.targets: list[str] = []
        self.loaded_step: int | None = None

    def load(self, directory: str | Path, step: int, within: Path | None = None) -> None:
        adapter = read_peft_adapter(directory, within)
        if adapter.rank > self.max_rank:
            raise AdapterError(f"{directory}: adapter rank {adapter.rank} is more than the run's rank {self.max_rank}")
        if self.lora is None:
            self.lora = apply_multi_lora(
                self.model, target_modules=adapter.target_modules, rank=self.max_rank, n_adapters=1
            )
            self.targets = adapter.target_modules
        elif adapter.target_modules != self.targets:
            raise AdapterError(f"{directory}: target_modules {adapter.target_modules} changed from {self.targets}")
        if set(adapter.modules) != set(self.lora.modules):
            missing = sorted(set(self.lora.modules) - set(adapter.modules))
            extra = sorted(set(adapter.modules) - set(self.lora.modules))
            raise AdapterError(
                f"{directory}: adapter modules do not match the model (missing {missing}, unknown {extra})"
            )
        for name, module in self.lora.modules.items():
            module.load_adapter_state_dict(0, adapter.modules[name])
        self.lora.lora_ranks[0] = adapter.rank
        self.lora.scaling_factors[0] = adapter.alpha / adapter.rank
        self.loaded_step = step

    @contextmanager
    def active(self, n_rows: int) -> Iterator[nn.Module]:
        """The model with every one of `n_rows` rows routed through the loaded adapter."""
        if self.lora is None:
            raise AdapterError("no adapter loaded yet")
        with self.lora.active_adapters(torch.zeros(n_rows, dtype=torch.long)):
            yield self.model
