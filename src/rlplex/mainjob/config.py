"""The main job's file: the trainer, the runs, and the events that happen while it runs.

name = "multirun-demo"
output_dir = "outputs/multirun-demo"
[model]                             # the shared base model: a hub id or a save_pretrained folder
name = "outputs/models/tiny-reverse"
[trainer]
world_size = 2
max_runs = 4
[[runs]]
id = "run_fast"
config = { env = { name = "reverse" }, max_steps = 12, batch_size = 16, optim = { lr = 5e-3 } }
[[later_runs]]                      # added by an event while the job runs
id = "run_late"
config = { ... }
[[events]]
when = { run = "run_fast", step = 3 }
add_run = "run_late"

[inference]                         # optional; engine = "auto" (vLLM on a GPU, else "hf") when left out
engine = "vllm"                     # one vLLM server for every run's adapter
max_loras = 4
[logging]                           # optional: trackers (`rlplex.diagnostics.trackers`), headless lines
wandb = true                        # one offline W&B run per run, grouped by the job's name
[dashboard]                         # optional: the master serves `rlplex dashboard`'s page while it runs
enabled = true                      # host = "127.0.0.1", port = 0 (any free one), allow_actions = false

A run's `model` table may leave out the model's fields: it gets the job's `[model]` (a run
that names another model is rejected by the trainer, with the reason in its control folder).
Likewise each run's `inference` table gets the job's engine settings, pointed at the job's
`inference/` folder, where the inference role publishes its servers and the job's API key lives,
and its `logging` table the job's `[logging]`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rlplex.config import StrictModel, load_config, read_toml, validate_config
from rlplex.dashboard.config import DashboardConfig
from rlplex.diagnostics.trackers import LoggingConfig
from rlplex.inference.config import InferenceConfig, resolve_engine
from rlplex.models.spec import ModelSpec
from rlplex.multirun.orchestrator.config import OrchestratorConfig, parse_orch_config
from rlplex.multirun.rundir import is_valid_run_name
from rlplex.multirun.rundir.retention import RetentionConfig

INFERENCE_DIR = "inference"
JOB_CONFIG_FILE = "main_job.json"  # the job as JSON, written at creation (`rlplex resume` and the view read it)


class TrainerSettings(StrictModel):
    world_size: int = Field(2, ge=1, le=8, description="torch.distributed ranks (gloo on CPU)")
    max_runs: int = Field(4, ge=1, description="adapter slots; more runs wait for a free slot")
    max_lora_rank: int = Field(8, ge=1, description="the largest LoRA rank a run may ask for (its adapter slot's size)")
    target_modules: list[str] | None = Field(
        None,
        min_length=1,
        description="the layers every run's LoRA adapter wraps, by the last part of their names, e.g. "
        '["q_proj", "v_proj", "lm_head"]; none: the model family\'s attention and MLP projections. "lm_head" lets '
        "an adapter sharpen the output distribution, which the final norm otherwise bounds",
    )
    micro_batch_tokens: int = Field(
        2048, ge=16, description="tokens per forward and backward pass; a step's rows are packed into micro-batches"
    )
    checkpoint_every: int = Field(1, ge=1, description="steps between a run's checkpoints")
    max_restarts: int = Field(3, ge=0, description="elastic restarts of the trainer before the job fails")
    max_off_policy_steps: int = Field(
        8, ge=0, description="rollouts this many steps older than the step they train are dropped"
    )
    retention: RetentionConfig = Field(
        default_factory=RetentionConfig, description="step folders of each run kept on disk"
    )


class RunEntry(StrictModel):
    id: str = Field(description="the run's id, run_<letters, digits, _ . ->: its folder under runs/")
    config: dict[str, Any] = Field(
        description="the run's config (see 'A run's config'); model fields it leaves out are the job's [model]"
    )

    @field_validator("id")
    @classmethod
    def _valid_id(cls, value: str) -> str:
        if not is_valid_run_name(value):
            raise ValueError(f"{value!r} is not a valid run id (expected run_<letters, digits, _ . ->)")
        return value

    def orch_config(self, source: str) -> OrchestratorConfig:
        return parse_orch_config(self.config, f"{source}: run {self.id!r}: config")

    def with_local_model_resolved(self) -> RunEntry:
        """This entry with its own `model.name`, when that is a folder here, made absolute: the
        job's master and nodes resolve a relative name in their own working directories."""
        table = self.config.get("model")
        name = table.get("name") if isinstance(table, dict) else None
        if not isinstance(table, dict) or not isinstance(name, str) or not Path(name).expanduser().is_dir():
            return self
        resolved = os.path.realpath(Path(name).expanduser())
        return self.model_copy(update={"config": {**self.config, "model": {**table, "name": resolved}}})

    def with_model(
        self,
        model: ModelSpec,
        inference: InferenceConfig | None = None,
        endpoint_dir: Path | None = None,
        logging: LoggingConfig | None = None,
    ) -> RunEntry:
        """This entry with the job's model (and engine and logging settings) filled into every
        field the run leaves out."""
        config = dict(self.config)
        own = config.get("logging", {})
        if logging is not None and isinstance(own, dict):
            config["logging"] = {**logging.model_dump(exclude_none=True), **own}
        table = config.get("model", {})
        if isinstance(table, dict):  # else the run's validation reports the bad table
            config["model"] = {**model.resolved().model_dump(exclude_none=True), **table}
        engine = config.get("inference", {})
        if inference is not None and endpoint_dir is not None and isinstance(engine, dict):
            settings = inference.engine_settings(str(endpoint_dir.resolve()))
            config["inference"] = {**settings.model_dump(exclude_none=True), **engine}
        return self.model_copy(update={"config": config})


class Trigger(StrictModel):
    run: str = Field(description="id of the run whose progress fires the event")
    step: int = Field(ge=0, description="fires once this run has finished this many trainer steps")


class Event(StrictModel):
    when: Trigger = Field(description="when it fires: { run = ID, step = N }")
    add_run: str | None = Field(None, description="id of a [[later_runs]] entry to add")
    evict_run: str | None = Field(None, description="id of a run to evict")
    reason: str = Field("evicted on purpose by the job's script", description="the eviction's reason, as reported")

    @model_validator(mode="after")
    def _one_action(self) -> Event:
        if (self.add_run is None) == (self.evict_run is None):
            raise ValueError("an event needs exactly one of add_run and evict_run")
        return self


class MainJobConfig(StrictModel):
    name: str = Field(min_length=1, description="the job's name (W&B groups its runs under it)")
    output_dir: Path = Field(description="the job's folder: runs, logs, report; relative to the working directory")
    backend: Literal["local", "ray"] = Field("local", description="where the nodes run: local processes or Ray")
    ray_address: str | None = Field(
        None, description="the Ray cluster to join (backend 'ray'); None starts a local Ray, 'auto' finds one"
    )
    model: ModelSpec = Field(description="The shared base model every run trains an adapter of.")
    trainer: TrainerSettings = Field(TrainerSettings(), description="The one trainer every run shares.")
    inference: InferenceConfig = Field(InferenceConfig(), description="The rollout engine: 'hf' or 'vllm' servers.")
    runs: list[RunEntry] = Field(min_length=1, description="[[runs]]: the runs the job starts with")
    later_runs: list[RunEntry] = Field(
        default_factory=list, description="[[later_runs]]: runs that an event adds while the job runs"
    )
    events: list[Event] = Field(
        default_factory=list, description="[[events]]: add or evict a run once another has trained N steps"
    )
    logging: LoggingConfig = Field(
        LoggingConfig(), description="Trackers of every run (a run's own [logging] keys win); headless lines."
    )
    dashboard: DashboardConfig = Field(
        DashboardConfig(), description="The web dashboard the master serves while the job runs (enabled = true)."
    )
    refresh_s: float = Field(0.5, gt=0, description="live view refresh period")
    timeout_s: float = Field(1800.0, gt=0, description="the job is stopped and failed after this long")

    @model_validator(mode="before")
    @classmethod
    def _runs_name_the_job_model(cls, data: Any) -> Any:
        """Fill each run's model fields from `[model]`, a local folder made absolute, so that
        every process (whatever its working directory) names the same model."""
        if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
            return data
        try:
            model = ModelSpec.model_validate(data["model"]).resolved()
            inference = InferenceConfig.model_validate(data.get("inference", {}))
        except ValueError:
            return data  # reported by the fields' own validation
        # "auto" becomes the engine it stands for here, once, so every run gets a concrete one.
        inference = inference.model_copy(update={"engine": resolve_engine(inference.engine, model.device)})
        data = {
            **data,
            "model": model.model_dump(),
            "inference": {**data.get("inference", {}), "engine": inference.engine},
        }
        endpoint_dir = Path(str(data.get("output_dir", "."))) / INFERENCE_DIR
        logging = job_logging(data)
        for key in ("runs", "later_runs"):
            entries = data.get(key)
            if isinstance(entries, list):
                data[key] = [_with_model(e, model, inference, endpoint_dir, logging) for e in entries]
        return data

    @model_validator(mode="after")
    def _consistent(self) -> MainJobConfig:
        ids = [entry.id for entry in self.runs + self.later_runs]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"run ids must be unique; repeated: {duplicates}")
        later = {entry.id for entry in self.later_runs}
        for number, event in enumerate(self.events):
            if event.when.run not in ids:
                raise ValueError(f"events[{number}].when.run: no run {event.when.run!r}")
            if event.add_run is not None and event.add_run not in later:
                raise ValueError(f"events[{number}].add_run: {event.add_run!r} is not in later_runs")
            if event.evict_run is not None and event.evict_run not in ids:
                raise ValueError(f"events[{number}].evict_run: no run {event.evict_run!r}")
        if self.inference.engine == "vllm" and self.inference.max_lora_rank < self.trainer.max_lora_rank:
            raise ValueError(
                f"inference.max_lora_rank: {self.inference.max_lora_rank} is below trainer.max_lora_rank "
                f"{self.trainer.max_lora_rank}: the servers would refuse the trainer's adapters"
            )
        return self

    def run_logging(self) -> LoggingConfig:
        """`[logging]` as each run gets it (a run added while the job runs too)."""
        return job_logging({"logging": self.logging.model_dump(), "name": self.name}) or self.logging

    @property
    def endpoint_dir(self) -> Path:
        """Where the inference role publishes its servers, beside the job's API key."""
        return self.output_dir / INFERENCE_DIR

    @property
    def runs_dir(self) -> Path:
        """Where the run directories live (the trainer's `output_dir` in the seed's terms)."""
        return self.output_dir / "runs"

    def check_runs(self, source: str) -> None:
        """Validate every run's orchestrator config now, before anything starts."""
        for entry in self.runs + self.later_runs:
            entry.orch_config(source)


def job_logging(data: dict[str, Any]) -> LoggingConfig | None:
    """The job's `[logging]` as each run gets it: W&B groups the job's runs under the job's name."""
    try:
        logging = LoggingConfig.model_validate(data.get("logging", {}))
    except ValueError:
        return None  # reported by the field's own validation
    if logging.wandb_group is None and isinstance(name := data.get("name"), str):
        logging = logging.model_copy(update={"wandb_group": name})
    return logging


def _with_model(
    entry: Any, model: ModelSpec, inference: InferenceConfig, endpoint_dir: Path, logging: LoggingConfig | None
) -> Any:
    """A run entry with the job's model filled in; one that is not valid is left for its own error."""
    try:
        return RunEntry.model_validate(entry).with_model(model, inference, endpoint_dir, logging)
    except ValueError:
        return entry


def load_main_job(path: str | Path, overrides: dict[str, Any] | None = None) -> MainJobConfig:
    """The job file `path`, its top-level fields replaced by `overrides` (the command line's
    `--output`, `--backend`...) before it is validated: what each run derives from them (its
    inference endpoint's folder under `output_dir`) follows the replaced value."""
    if not overrides:
        config = load_config(MainJobConfig, path)
    else:
        data = read_toml(path) | overrides
        config = validate_config(MainJobConfig, data, source=f"{path} (with flags and environment)")
    config.check_runs(str(path))
    return config
