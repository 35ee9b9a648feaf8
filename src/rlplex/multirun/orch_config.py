"""The orchestrator config a run writes to `control/orch.toml`, and the guarded reader for it.

The trainer reads files that other processes (one orchestrator per run) write, so every way
a file can be bad is a reason string, never an exception that stops the trainer: missing,
not a regular file (a FIFO would block the read forever), too big, unreadable, not UTF-8,
not TOML, not matching the model. Types are strict: `rank = "8"` is an error, not an 8,
because a config that only works by coercion is a typo waiting to bite.
"""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, ValidationError

from rlplex.config import StrictModel, format_validation_error
from rlplex.errors import RunConfigError
from rlplex.multirun.rundir import RunDir

MAX_ORCH_CONFIG_BYTES = 1_000_000


class _Strict(StrictModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class LoraConfig(_Strict):
    rank: int = Field(8, ge=1, description="The run's own LoRA rank (at most the trainer's maximum rank).")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the adapter output is scaled by alpha / rank.")


class ModelConfig(_Strict):
    lora: LoraConfig = LoraConfig()


class OptimConfig(_Strict):
    lr: float = Field(1e-4, gt=0)
    max_grad_norm: float = Field(1.0, gt=0, description="Clipping threshold over this run's adapter only.")
    weight_decay: float = Field(0.0, ge=0)


class OrchestratorConfig(_Strict):
    """What one run asks of the shared trainer. Unknown keys are errors."""

    task: str = Field(min_length=1, description="Name of the verifiable task the run trains on.")
    seed: int = 0
    max_steps: int = Field(ge=1, description="The run's own schedule length (not the trainer's).")
    batch_size: int = Field(ge=1, description="Samples per step of this run.")
    max_async_level: int = Field(1, ge=0, description="Steps the rollouts may lag the weights; 0 = synchronous.")
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()


def parse_orch_config(data: dict[str, Any], source: str) -> OrchestratorConfig:
    try:
        return OrchestratorConfig.model_validate(data)
    except ValidationError as error:
        raise RunConfigError(format_validation_error(source, error)) from None


def read_orch_config(path: Path, max_bytes: int = MAX_ORCH_CONFIG_BYTES) -> OrchestratorConfig:
    """Read and validate one `orch.toml`; every failure is a `RunConfigError` naming file and reason."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise RunConfigError(f"{path}: config file not found") from None
    except OSError as error:
        raise RunConfigError(f"{path}: cannot stat config file: {error}") from None
    if not stat.S_ISREG(info.st_mode):
        raise RunConfigError(f"{path}: not a regular file (mode {stat.filemode(info.st_mode)})")
    if info.st_size > max_bytes:
        raise RunConfigError(f"{path}: config file is {info.st_size} bytes, more than the limit of {max_bytes}")
    try:
        with open(path, "rb") as handle:
            # Read one byte past the limit: the file may have grown since the stat.
            raw = handle.read(max_bytes + 1)
    except OSError as error:
        raise RunConfigError(f"{path}: cannot read config file: {error}") from None
    if len(raw) > max_bytes:
        raise RunConfigError(f"{path}: config file is more than the limit of {max_bytes} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RunConfigError(f"{path}: config file is not UTF-8 text: {error}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise RunConfigError(f"{path}: not valid TOML: {error}") from None
    return parse_orch_config(data, str(path))


def orch_config_to_toml(config: OrchestratorConfig) -> str:
    """Serialise a config as TOML (tomllib has no writer; the model is two levels deep)."""

    def value(item: Any) -> str:
        if isinstance(item, bool):
            return "true" if item else "false"
        if isinstance(item, int | float):
            return repr(item)
        if isinstance(item, str):
            return '"' + item.replace("\\", "\\\\").replace('"', '\\"') + '"'
        raise TypeError(f"cannot write {type(item).__name__} to TOML")

    def table(prefix: str, data: dict[str, Any], out: list[str]) -> None:
        scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
        if prefix and scalars:
            out.append(f"[{prefix}]")
        out.extend(f"{k} = {value(v)}" for k, v in scalars.items())
        for key, sub in data.items():
            if isinstance(sub, dict):
                table(f"{prefix}.{key}" if prefix else key, sub, out)

    lines: list[str] = []
    table("", config.model_dump(), lines)
    return "\n".join(lines) + "\n"


def create_run(output_dir: Path, run_id: str, config: OrchestratorConfig) -> RunDir:
    """What an orchestrator does first: make its run directory and write `control/orch.toml` atomically.

    The config is written to a temporary file and renamed, so the trainer never reads half of it.
    """
    run = RunDir(Path(output_dir), run_id)
    os.makedirs(run.root, exist_ok=True)
    run.write_text(run.orch_config, orch_config_to_toml(config))
    return run
