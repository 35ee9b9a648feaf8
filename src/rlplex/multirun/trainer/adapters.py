"""The LoRA side of the multi-run manager: registered modules, per-run parameters, the batch's adapters.

`MultiLoRALinear.register_with_runs(manager, name)` calls `register_lora_module`; the
module keeps references to `manager.scaling_factors` and `manager.lora_ranks` and reads
`manager.adapter_batch` (shared `AdapterBatch`) at forward time, which `active_adapters(ids)` sets for one forward
pass. Parameter names are prefixed with the module name, as in the model's state dict.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from rlplex.errors import MultiRunError
from rlplex.multirun.trainer.lora import AdapterBatch


class LoraModule(Protocol):
    def named_parameters_for_adapter(self, idx: int) -> Iterator[tuple[str, torch.Tensor]]: ...
    def adapter_state_dict(self, idx: int) -> dict[str, torch.Tensor]: ...
    def reset_adapter(self, idx: int) -> None: ...


class AdapterRegistry:
    """Mixed into `MultiRunManager`; needs `idx_2_id` (the active slots)."""

    idx_2_id: dict[int, str]
    lora_modules: dict[str, LoraModule]
    adapter_batch: AdapterBatch

    def register_lora_module(self, name: str, module: LoraModule) -> None:
        if name in self.lora_modules:
            raise MultiRunError(f"a LoRA module named {name!r} is already registered")
        self.lora_modules[name] = module

    def max_lora_rank(self) -> int | None:
        ranks = [int(r) for m in self.lora_modules.values() if isinstance(r := getattr(m, "rank", None), int)]
        return min(ranks) if ranks else None

    def get_named_parameters_for_run(self, idx: int) -> list[tuple[str, torch.Tensor]]:
        return [
            (f"{name}.{key}", param)
            for name, module in self.lora_modules.items()
            for key, param in module.named_parameters_for_adapter(idx)
        ]

    def get_state_dict_for_run(self, idx: int) -> dict[str, torch.Tensor]:
        return {
            f"{name}.{key}": tensor
            for name, module in self.lora_modules.items()
            for key, tensor in module.adapter_state_dict(idx).items()
        }

    def reset_run_parameters(self, idx: int) -> None:
        with torch.no_grad():
            for module in self.lora_modules.values():
                module.reset_adapter(idx)

    @contextmanager
    def active_adapters(self, adapter_ids: torch.Tensor, check: bool = True) -> Iterator[AdapterBatch]:
        """Set the adapter slot of each row for the forward pass run inside the block."""
        if check:
            if adapter_ids.dtype not in (torch.int32, torch.int64):
                raise MultiRunError(f"adapter ids must be int32 or int64, got {adapter_ids.dtype}")
            unknown = sorted(set(adapter_ids.unique().tolist()) - set(self.idx_2_id) - {-1})  # -1: base only
            if unknown:
                raise MultiRunError(f"adapter ids {unknown} name no active run (active slots: {sorted(self.idx_2_id)})")
        with self.adapter_batch.active(adapter_ids):
            yield self.adapter_batch

    @property
    def adapter_ids(self) -> torch.Tensor | None:
        return self.adapter_batch.ids
