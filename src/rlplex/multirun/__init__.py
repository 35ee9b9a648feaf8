"""One trainer, many runs: the run directory protocol and the `MultiRunManager` (seeds 000, 001).

The trainer (`rlplex.multirun.trainer.MultiRunTrainer`, `python -m rlplex.multirun.trainer`) is
not imported here: it loads transformers, which the run-directory side does not need.
"""

from rlplex.multirun.checkpoint import RunCheckpoint, RunProgress, load_checkpoint
from rlplex.multirun.lora import AdapterBatch, MultiLoRALinear, MultiLoRAModules, apply_multi_lora
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
from rlplex.multirun.run_optim import RunOptimizers, clipped_pg_loss
from rlplex.multirun.rundir import STABLE_MARKER, RunDir

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
    "clipped_pg_loss",
    "create_run",
    "get_multi_run_manager",
    "load_checkpoint",
    "orch_config_to_toml",
    "read_orch_config",
    "setup_multi_run_manager",
    "write_peft_adapter",
]
