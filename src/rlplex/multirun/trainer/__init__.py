"""The multi-run trainer (seed 000): `MultiRunTrainer` (`loop`), its `MultiRunManager` of runs in
LoRA slots (`manager`, `adapters`, `hooks`, `sync`, `discovery`), the packer, per-run optimisers,
its config and its outputs. `python -m rlplex.multirun.trainer` runs it standalone.

`rlplex.multirun.trainer:run_trainer` is the entry point of the main job's trainer role. Names
resolve on first use: the job file's check reads `run_trainer`'s config model without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlplex.multirun.trainer.config import TrainerConfig
    from rlplex.multirun.trainer.loop import MultiRunTrainer
    from rlplex.multirun.trainer.main import run_trainer

_WHERE = {"MultiRunTrainer": "loop", "TrainerConfig": "config", "run_trainer": "main"}
__all__ = ["MultiRunTrainer", "TrainerConfig", "run_trainer"]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'rlplex.multirun.trainer' has no attribute '{name}'")
    return getattr(importlib.import_module(f"rlplex.multirun.trainer.{module}"), name)
