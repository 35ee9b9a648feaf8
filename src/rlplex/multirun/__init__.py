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
    "AdapterBatch": "rlplex.multirun.trainer.lora",
    "EMPTY_SLOT_SCALING": "rlplex.multirun.trainer.manager",
    "LoraConfig": "rlplex.multirun.orchestrator.config",
    "MAX_ORCH_CONFIG_BYTES": "rlplex.multirun.orchestrator.config",
    "MicroBatch": "rlplex.multirun.trainer.packer",
    "ModelConfig": "rlplex.multirun.orchestrator.config",
    "MultiLoRALinear": "rlplex.multirun.trainer.lora",
    "MultiLoRAModules": "rlplex.multirun.trainer.lora",
    "MultiRunManager": "rlplex.multirun.trainer.manager",
    "OptimConfig": "rlplex.multirun.orchestrator.config",
    "OrchestratorConfig": "rlplex.multirun.orchestrator.config",
    "Packer": "rlplex.multirun.trainer.packer",
    "RunCheckpoint": "rlplex.multirun.rundir.checkpoint",
    "RunDir": "rlplex.multirun.rundir",
    "RunOptimizers": "rlplex.multirun.trainer.run_optim",
    "RunProgress": "rlplex.multirun.rundir.checkpoint",
    "RunStatus": "rlplex.multirun.trainer.manager",
    "STABLE_MARKER": "rlplex.multirun.rundir",
    "apply_multi_lora": "rlplex.multirun.trainer.lora",
    "create_run": "rlplex.multirun.orchestrator.config",
    "default_target_modules": "rlplex.multirun.trainer.lora",
    "get_multi_run_manager": "rlplex.multirun.trainer.manager",
    "load_checkpoint": "rlplex.multirun.rundir.checkpoint",
    "orch_config_to_toml": "rlplex.multirun.orchestrator.config",
    "read_orch_config": "rlplex.multirun.orchestrator.config",
    "setup_multi_run_manager": "rlplex.multirun.trainer.manager",
    "write_peft_adapter": "rlplex.multirun.rundir.peft_export",
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
    from rlplex.multirun.orchestrator.config import (
        MAX_ORCH_CONFIG_BYTES,
        LoraConfig,
        ModelConfig,
        OptimConfig,
        OrchestratorConfig,
        create_run,
        orch_config_to_toml,
        read_orch_config,
    )
    from rlplex.multirun.rundir import STABLE_MARKER, RunDir
    from rlplex.multirun.rundir.checkpoint import RunCheckpoint, RunProgress, load_checkpoint
    from rlplex.multirun.rundir.peft_export import write_peft_adapter
    from rlplex.multirun.trainer.lora import (
        AdapterBatch,
        MultiLoRALinear,
        MultiLoRAModules,
        apply_multi_lora,
        default_target_modules,
    )
    from rlplex.multirun.trainer.manager import (
        EMPTY_SLOT_SCALING,
        MultiRunManager,
        RunStatus,
        get_multi_run_manager,
        setup_multi_run_manager,
    )
    from rlplex.multirun.trainer.packer import MicroBatch, Packer
    from rlplex.multirun.trainer.run_optim import RunOptimizers
