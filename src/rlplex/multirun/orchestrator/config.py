"""The orchestrator config a run writes to `control/orch.toml`, and the guarded reader for it.

The trainer reads files that other processes (one orchestrator per run) write, so every way
a file can be bad is a reason string, never an exception that stops the trainer: missing,
not a regular file (a FIFO would block the read forever), too big, unreadable, not UTF-8,
not TOML, not matching the model. Types are strict: `rank = "8"` is an error, not an 8,
because a config that only works by coercion is a typo waiting to bite.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from rlplex.config import StrictModel, format_validation_error, toml_value
from rlplex.diagnostics.trackers import LoggingConfig
from rlplex.errors import MultiRunError, RunConfigError
from rlplex.inference.config import EngineSettings
from rlplex.io.safe_files import read_regular_file
from rlplex.models.spec import ModelSpec
from rlplex.multirun.rundir import RunDir, run_folder_problem
from rlplex.tasks import EnvSpec
from rlplex.tasks.reward_guard import DEFAULT_DEADLINE_S

MAX_ORCH_CONFIG_BYTES = 1_000_000


class _Strict(StrictModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class LoraConfig(_Strict):
    rank: int = Field(8, ge=1, description="The run's own LoRA rank (at most the trainer's maximum rank).")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the adapter output is scaled by alpha / rank.")


class ModelConfig(ModelSpec):
    """`[model]` of a run: the shared base model (`ModelSpec`: it must be the trainer's, or the
    trainer rejects the run) plus the run's own LoRA adapter."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    lora: LoraConfig = Field(LoraConfig(), description="The run's LoRA adapter.")


class OptimConfig(_Strict):
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate of this run's adapter.")
    max_grad_norm: float = Field(1.0, gt=0, description="Clipping threshold over this run's adapter only.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay of this run's adapter.")


class LossConfig(_Strict):
    """`loss` of a run: how the shared trainer turns its rollouts into its adapter's gradient."""

    decoupled: bool = Field(
        False,
        description="AReaL's decoupled PPO: the ratio is taken against the adapter as it is before the step (the "
        "proximal policy), and each token is re-weighted by proximal / behaviour (the policy that sampled it), so "
        "rollouts that lag the weights (max_async_level > 0) or come from another engine's numerics stay usable.",
    )
    behav_imp_weight_cap: float = Field(
        5.0,
        gt=1.0,
        description="With decoupled: tokens whose proximal / behaviour weight exceeds this get weight 0 (inf: no cap).",
    )


class EvaluationConfig(_Strict):
    """`evaluation` of a run: its policy scored on fixed examples it never trains on, as it learns.

    The examples come from `env` when given, else from the run's environment with
    `split = "heldout"` when it sets a `heldout_fraction` (problems no step draws), else from the
    run's environment itself (a fixed, seeded set). Each evaluation generates one completion per
    example with the run's current adapter on the run's engine, once per temperature (0 =
    greedy), and appends accuracy and mean reward to the run's `eval.csv` (and TensorBoard)."""

    every: int = Field(
        10, ge=1, description="Evaluate policy step 0, once in each block of `every` steps after it, and the last."
    )
    examples: int = Field(200, ge=1, le=100_000, description="Held-out examples scored each time.")
    temperatures: list[float] = Field([0.0, 1.0], min_length=1, description="One evaluation each; 0 = greedy.")
    seed: int = Field(1_000_003, description="Seed of the evaluation's examples and sampling (the same every time).")
    env: EnvSpec | None = Field(None, description="Where the examples come from; None: the run's environment.")

    @field_validator("temperatures")
    @classmethod
    def _temperatures(cls, value: list[float]) -> list[float]:
        if any(not 0 <= t <= 10 for t in value):
            raise ValueError(f"each temperature must be between 0 and 10 (got {value})")
        return value

    def env_spec(self, run_env: EnvSpec) -> EnvSpec:
        if self.env is not None:
            return self.env
        settings = dict(run_env.model_extra or {})
        fraction = settings.get("heldout_fraction")
        if isinstance(fraction, int | float) and fraction > 0:
            settings["split"] = "heldout"
        return EnvSpec(name=run_env.name, **settings)


class OrchestratorConfig(_Strict):
    """What one run asks of the shared trainer. Unknown keys are errors."""

    env: EnvSpec = Field(description='The environment: data plus reward, e.g. { name = "reverse" }.')
    seed: int = Field(0, description="Seed of the run's prompts and sampling.")
    max_steps: int = Field(ge=1, description="The run's own schedule length (not the trainer's).")
    batch_size: int = Field(ge=1, description="Samples per step of this run (prompts x group_size).")
    group_size: int = Field(
        2,
        ge=2,
        validate_default=True,
        description="Completions per prompt; advantages are normalised within a group. Divides batch_size.",
    )
    max_new_tokens: int | None = Field(None, ge=1, description="Generation length; None = the environment's.")
    temperature: float = Field(1.0, ge=0, le=10, description="Sampling temperature; 0 = greedy.")
    max_async_level: int = Field(1, ge=0, description="Steps the rollouts may lag the weights; 0 = synchronous.")
    rollout_workers: int = Field(
        1, ge=1, le=64, description="Processes that generate (actor_gen); 1 = in the orchestrator's own process."
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="Torch CPU threads of the process that generates with transformers (engine hf). None: "
        "torch's default (every core), or in a main job the cores its trainer ranks leave, shared by its runs.",
    )
    model: ModelConfig = Field(description="The base model (in a main job: the job's [model]) and the run's LoRA.")
    optim: OptimConfig = Field(OptimConfig(), description="The run's own AdamW optimizer.")
    loss: LossConfig = Field(LossConfig(), description="The run's objective: plain or decoupled PPO.")
    inference: EngineSettings = Field(
        EngineSettings(), description="How rollouts are generated: in process (hf) or on the job's vLLM servers."
    )
    evaluation: EvaluationConfig | None = Field(None, description="Score the policy on held-out examples as it learns.")
    logging: LoggingConfig = Field(
        LoggingConfig(), description="Trackers of the run's metrics (TensorBoard, W&B); a main job sets its [logging]."
    )
    reward_timeout_s: float = Field(
        DEFAULT_DEADLINE_S,
        gt=0,
        le=3600,
        description="Deadline of one reward call; a call past it is killed and scores 0 (rlplex.tasks.reward_guard).",
    )

    @model_validator(mode="after")
    def _engine_is_reachable(self) -> OrchestratorConfig:
        if self.inference.engine == "vllm":
            if self.inference.endpoint_dir is None:
                raise ValueError(
                    "inference.endpoint_dir: engine 'vllm' needs the folder of the job's inference servers"
                )
            if self.rollout_workers != 1:
                raise ValueError(
                    f"rollout_workers: {self.rollout_workers} with engine 'vllm' (the server batches; use 1)"
                )
        if self.evaluation is not None and self.rollout_workers != 1:
            raise ValueError(
                f"evaluation: the orchestrator evaluates on its own engine; rollout_workers = {self.rollout_workers} "
                "leaves it none (use 1)"
            )
        return self

    @field_validator("group_size")
    @classmethod
    def _group_divides_batch(cls, value: int, info: ValidationInfo) -> int:
        batch = info.data.get("batch_size")
        if isinstance(batch, int) and batch % value:
            raise ValueError(f"batch_size {batch} is not a multiple of group_size {value}")
        return value


def parse_orch_config(data: dict[str, Any], source: str) -> OrchestratorConfig:
    try:
        return OrchestratorConfig.model_validate(data)
    except ValidationError as error:
        raise RunConfigError(format_validation_error(source, error)) from None


def read_orch_config(
    path: Path, max_bytes: int = MAX_ORCH_CONFIG_BYTES, *, follow_symlinks: bool = False, within: Path | None = None
) -> OrchestratorConfig:
    """Read and validate one `orch.toml`; every failure is a `RunConfigError` naming file and reason.

    A run's own `control/orch.toml` is never followed through a symlink (`within`: the run's
    folder, which no folder on the way may lead out of); `follow_symlinks` is for a path the
    user typed."""
    try:
        raw = read_regular_file(path, max_bytes, within, follow_symlinks=follow_symlinks)
    except FileNotFoundError:
        raise RunConfigError(f"{path}: config file not found") from None
    except OSError as error:  # UnsafeFileError (a FIFO, a symlink, too big) included
        raise RunConfigError(f"{path}: cannot read config file: {error}") from None
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
    """Serialise a config as TOML (the model is two levels deep: one table per section)."""

    def table(prefix: str, data: dict[str, Any], out: list[str]) -> None:
        # TOML has no null: a None field is left out and reads back as its default (None).
        scalars = {k: v for k, v in data.items() if not isinstance(v, dict) and v is not None}
        if prefix and scalars:
            out.append(f"[{prefix}]")
        out.extend(f"{k} = {toml_value(v)}" for k, v in scalars.items())
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
    problem = run_folder_problem(run.root)  # the trainer's test: a linked folder is not the run's
    if problem is not None:
        raise MultiRunError(f"{run.root}: cannot be the folder of {run_id}: {problem}")
    run.ensure_identity()  # before orch.toml: the trainer must never see this run without its identity
    run.write_text(run.orch_config, orch_config_to_toml(config))
    return run


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        flat.update(_flatten(value, name + ".") if isinstance(value, dict) else {name: value})
    return flat


def config_changes(before: OrchestratorConfig, after: OrchestratorConfig) -> list[str]:
    """Each field that differs, as `dotted.name: old -> new`."""
    old, new = _flatten(before.model_dump(mode="json")), _flatten(after.model_dump(mode="json"))
    keys = sorted(old.keys() | new.keys())
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in keys if old.get(key) != new.get(key)]


def frozen_config_reason(path: Path, admitted: OrchestratorConfig, now: OrchestratorConfig) -> str:
    """Why a run whose admitted config was changed is evicted, naming each changed field."""
    return (
        f"{path} changed while the run was active ({'; '.join(config_changes(admitted, now))}); the config of an "
        "admitted run is frozen. Restore it and delete control/evicted.txt to continue, or start a new run id"
    )
