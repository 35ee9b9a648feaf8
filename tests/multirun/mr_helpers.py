"""Shared helpers for the multi-run tests (imported by name: tests/multirun is on sys.path)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from lm_models import untrained_tiny_model
from rlplex.multirun import OrchestratorConfig, RunDir, create_run

Snapshot = dict[str, tuple[str, bytes | str, int]]


def snapshot(root: Path) -> Snapshot:
    """Every entry under `root`, links not followed: kind, bytes (or link target), mtime. Two
    equal snapshots: nothing below `root` was written, made or removed."""
    found: Snapshot = {}
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(folder) / name
            info = os.lstat(path)
            if path.is_symlink():
                found[str(path)] = ("link", os.readlink(path), info.st_mtime_ns)
            elif path.is_dir():
                found[str(path)] = ("dir", b"", info.st_mtime_ns)
            else:
                found[str(path)] = ("file", path.read_bytes(), info.st_mtime_ns)
    return found


def make_config(**overrides: object) -> OrchestratorConfig:
    """A valid run config on the untrained tiny checkpoint; `model` overrides merge into its table."""
    model = {"name": str(untrained_tiny_model()), **dict(overrides.pop("model", {}))}  # type: ignore[call-overload]
    data: dict[str, object] = {"env": {"name": "reverse"}, "max_steps": 10, "batch_size": 4, "model": model}
    data.update(overrides)
    return OrchestratorConfig.model_validate(data)


def new_run(output_dir: Path, name: str, **overrides: object) -> RunDir:
    """Create `run_<name>` with a valid orch.toml, as an orchestrator would."""
    return create_run(output_dir, name, make_config(**overrides))


class StandInLora(nn.Module):
    """The smallest stand-in for MultiLoRALinear (built by the other half of the multi-run work):
    one A [n, r, in] and B [n, out, r] per slot, with the module interface the manager uses."""

    def __init__(self, n_adapters: int, rank: int, d_in: int = 3, d_out: int = 2) -> None:
        super().__init__()
        self.rank = rank
        self.lora_A = nn.Parameter(torch.zeros(n_adapters, rank, d_in))
        self.lora_B = nn.Parameter(torch.ones(n_adapters, d_out, rank))
        self.ranks: torch.Tensor | None = None

    def named_parameters_for_adapter(self, idx: int) -> Iterator[tuple[str, torch.Tensor]]:
        yield "lora_A.weight", self.lora_A[idx]
        yield "lora_B.weight", self.lora_B[idx]

    def adapter_state_dict(self, idx: int) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.named_parameters_for_adapter(idx)}

    def reset_adapter(self, idx: int) -> None:
        nn.init.kaiming_uniform_(self.lora_A[idx], a=math.sqrt(5))
        self.lora_B[idx].zero_()
