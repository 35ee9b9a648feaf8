"""One trainer, many runs: the run directory protocol and the `MultiRunManager` (seeds 000, 001).

The trainer (`rlplex.multirun.trainer.MultiRunTrainer`, `python -m rlplex.multirun.trainer`) is
not imported here: it loads transformers, which the run-directory side does not need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlplex.lazy import lazy_getattr

# Names resolve on first use (PEP 562): `rlplex status` reads run folders through this package
# and must not pay for torch, which most of these modules import.
_EXPORTS = {
    "AdapterBatch": "trainer.lora",
    "EMPTY_SLOT_SCALING": "trainer.manager",
    "LoraConfig": "orchestrator.config",
    "LossConfig": "orchestrator.config",
    "MAX_ORCH_CONFIG_BYTES": "orchestrator.config",
    "MicroBatch": "trainer.packer",
    "ModelConfig": "orchestrator.config",
    "MultiLoRALinear": "trainer.lora",
    "MultiLoRAModules": "trainer.lora_apply",
    "MultiRunManager": "trainer.manager",
    "OptimConfig": "orchestrator.config",
    "OrchestratorConfig": "orchestrator.config",
    "Packer": "trainer.packer",
    "RunCheckpoint": "rundir.checkpoint",
    "RunDir": "rundir",
    "RunOptimizers": "trainer.run_optim",
    "RunProgress": "rundir.checkpoint",
    "RunStatus": "trainer.discovery",
    "STABLE_MARKER": "rundir",
    "apply_multi_lora": "trainer.lora_apply",
    "create_run": "orchestrator.config",
    "default_target_modules": "trainer.lora_apply",
    "get_multi_run_manager": "trainer.manager",
    "load_checkpoint": "rundir.checkpoint",
    "orch_config_to_toml": "orchestrator.config",
    "read_orch_config": "orchestrator.config",
    "setup_multi_run_manager": "trainer.manager",
    "write_peft_adapter": "rundir.peft_export",
}


__all__ = [
    "EMPTY_SLOT_SCALING",
    "MAX_ORCH_CONFIG_BYTES",
    "STABLE_MARKER",
    "AdapterBatch",
    "LoraConfig",
    "LossConfig",
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


__getattr__ = lazy_getattr(__name__, _EXPORTS)


if TYPE_CHECKING:
    from rlplex.multirun.orchestrator.config import (
        MAX_ORCH_CONFIG_BYTES,
        LoraConfig,
        LossConfig,
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
    from rlplex.multirun.trainer.discovery import RunStatus
    from rlplex.multirun.trainer.lora import AdapterBatch, MultiLoRALinear
    from rlplex.multirun.trainer.lora_apply import MultiLoRAModules, apply_multi_lora, default_target_modules
    from rlplex.multirun.trainer.manager import (
        EMPTY_SLOT_SCALING,
        MultiRunManager,
        get_multi_run_manager,
        setup_multi_run_manager,
    )
    from rlplex.multirun.trainer.packer import MicroBatch, Packer
    from rlplex.multirun.trainer.run_optim import RunOptimizers
