"""`[model]`: the one setting that names a language model everywhere (trainer, orchestrators,
rewards, every run's `orch.toml`). Imports no torch, so configs can be validated anywhere.

``name`` is a Hugging Face hub id or a local folder in `save_pretrained` layout. Two specs
name the same model when their `identity()` agrees: a local folder is compared by its real
path (so ``outputs/tiny`` and ``./outputs/tiny/`` are one model), a hub id by id and revision.
``dtype`` and ``device`` say how *this* process holds the model, not which model it is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from rlplex.config import StrictModel

DType = Literal["auto", "float32", "bfloat16"]
Device = Literal["auto", "cpu", "cuda"]


class ModelSpec(StrictModel):
    name: str = Field(min_length=1, description="Hugging Face hub id or a local save_pretrained folder.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit); None = the default.")
    dtype: DType = Field("auto", description="Frozen base weights: auto = bfloat16 on CUDA, float32 on CPU.")
    trust_remote_code: bool = Field(False, description="Allow the checkpoint's own modelling code (off: safer).")
    device: Device = Field("auto", description="auto = CUDA when present, else CPU; cuda without a GPU is an error.")

    @property
    def is_local(self) -> bool:
        return Path(self.name).expanduser().is_dir()

    def identity(self) -> str:
        """What must agree between the trainer and a run for them to share one base model."""
        if self.is_local:
            return os.path.realpath(Path(self.name).expanduser())
        return self.name if self.revision is None else f"{self.name}@{self.revision}"

    def local_file(self, name: str) -> Path | None:
        """The file `name` of this spec's local folder, if it holds one (None for a hub id)."""
        if not self.is_local:
            return None
        path = Path(self.name).expanduser() / name
        return path if path.is_file() else None

    def local_config(self) -> dict[str, Any] | None:
        """A local folder's config.json read as JSON, without transformers (None: no folder, no
        such file, or not a JSON object): what the checks before a job start read of it."""
        path = self.local_file("config.json")
        if path is None:
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def resolved(self) -> ModelSpec:
        """This spec with a local folder made absolute: safe to hand to a process with another cwd."""
        if not self.is_local:
            return self
        return self.model_copy(update={"name": os.path.realpath(Path(self.name).expanduser())})


__all__ = ["DType", "Device", "ModelSpec"]
