"""The multi-run trainer (seed 000): `MultiRunTrainer` (`loop`), its `MultiRunManager` of runs in
LoRA slots (`manager`, `adapters`, `hooks`, `sync`, `discovery`: scan and ledger), the packer,
per-run optimisers, its config and its outputs (`outputs`, written through `log`'s writer).
`python -m rlplex.multirun.trainer` runs it standalone, as a control-plane job of its own
(`job`: the trainer's roles, shared with the main job).

`rlplex.multirun.trainer:run_trainer` is the entry point of every trainer rank. Names
resolve on first use: the job file's check reads `run_trainer`'s config model without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlplex.lazy import lazy_getattr

if TYPE_CHECKING:
    from rlplex.multirun.trainer.config import TrainerConfig
    from rlplex.multirun.trainer.loop import MultiRunTrainer
    from rlplex.multirun.trainer.main import run_trainer

_WHERE = {"MultiRunTrainer": "loop", "TrainerConfig": "config", "run_trainer": "main"}
__all__ = ["MultiRunTrainer", "TrainerConfig", "run_trainer"]

__getattr__ = lazy_getattr(__name__, _WHERE)
