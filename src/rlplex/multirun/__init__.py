"""One trainer, many runs: the run directory protocol and the `MultiRunManager` (seeds 000, 001).

The trainer (`rlplex.multirun.trainer.MultiRunTrainer`, `python -m rlplex.multirun.trainer`) is
not imported here: it loads transformers, which the run-directory side does not need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Names resolve on first use (PEP 562): `rlplex status` reads run folders through this package
# and must not pay for torch, which most of these modules import.
_EXPORTS = {
    "AdapterBatch": "rlplex.multirun.lora",
    "EMPTY_SLOT_SCALING": "rlplex.multirun.manager",
    "LoraConfig": "rlplex.multirun.orch_config",
    "MAX_ORCH_CONFIG_BYTES": "rlplex.multirun.orch_config",
    "MicroBatch": "rlplex.multirun.packer",
    "ModelConfig": "rlplex.multirun.orch_config",
    "MultiLoRALinear": "rlplex.multirun.lora",
    "MultiLoRAModules": "rlplex.multirun.lora",
    "MultiRunManager": "rlplex.multirun.manager",
    "OptimConfig": "rlplex.multirun.orch_config",
    "OrchestratorConfig": "rlplex.multirun.orch_config",
    "Packer": "rlplex.multirun.packer",
    "RunCheckpoint": "rlplex.multirun.checkpoint",
    "RunDir": "rlplex.multirun.rundir",
    "RunOptimizers": "rlplex.multirun.run_optim",
    "RunProgress": "rlplex.multirun.checkpoint",
    "RunStatus": "rlplex.multirun.manager",
    "STABLE_MARKER": "rlplex.multirun.rundir",
    "apply_multi_lora": "rlplex.multirun.lora",
    "create_run": "rlplex.multirun.orch_config",
    "default_target_modules": "rlplex.multirun.lora",
    "get_multi_run_manager": "rlplex.multirun.manager",
    "load_checkpoint": "rlplex.multirun.checkpoint",
    "orch_config_to_toml": "rlplex.multirun.orch_config",
    "read_orch_config": "rlplex.multirun.orch_config",
    "setup_multi_run_manager": "rlplex.multirun.manager",
    "write_peft_adapter": "rlplex.multirun.peft_export",
}


__all__ = [
    "EMPTY_SLOT_SCALING",
    "MAX_ORCH_CONFIG_BYTES",
    "STABLE_MARKER",
    "AdapterBatch",
    "LoraConfig",
    "MicroBatch",
    "ModelConfig",
    "MultiLoRALinear",
    "MultiLoRAModules",
    "MultiRunManager",
    "OptimConfig",
    "OrchestratorConfig",
    "Packer",
    "RunCheckpoint",
    "RunDir",
    "RunOptimizers",
    "RunProgress",
    "RunStatus",
    "apply_multi_lora",
    "create_run",
    "default_target_modules",
    "get_multi_run_manager",
    "load_checkpoint",
    "orch_config_to_toml",
    "read_orch_config",
    "setup_multi_run_manager",
    "write_peft_adapter",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlplex.multirun' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from rlplex.multirun.checkpoint import RunCheckpoint, RunProgress, load_checkpoint
    from rlplex.multirun.lora import (
        AdapterBatch,
        MultiLoRALinear,
        MultiLoRAModules,
        apply_multi_lora,
        default_target_modules,
    )
    from rlplex.multirun.manager import (
        EMPTY_SLOT_SCALING,
        MultiRunManager,
        RunStatus,
        get_multi_run_manager,
        setup_multi_run_manager,
    )
    from rlplex.multirun.orch_config import (
        MAX_ORCH_CONFIG_BYTES,
        LoraConfig,
        ModelConfig,
        OptimConfig,
        OrchestratorConfig,
        create_run,
        orch_config_to_toml,
        read_orch_config,
    )
    from rlplex.multirun.packer import MicroBatch, Packer
    from rlplex.multirun.peft_export import write_peft_adapter
    from rlplex.multirun.run_optim import RunOptimizers
    from rlplex.multirun.rundir import STABLE_MARKER, RunDir
