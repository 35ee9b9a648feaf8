"""Checks of a main job against its trainer before any process starts.

The trainer judges each run when it discovers it (LoRA rank, base model, async level); a run
it rejects there has cost a job start and, before this check, ended with nothing trained.
Everything the files already tell is checked here instead, and every problem is reported at
once, one line each: the trainer's own rules, and sizes that cannot fit in this machine's
memory (a huge `batch_size` or `max_runs` would otherwise fail or stall long after start).

The memory figures are lower bounds from the model's `config.json` (no weights are loaded):
a job refused here could never run; one accepted may still be tight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlplex.errors import ConfigError, RlplexError
from rlplex.inference.config import cuda_present
from rlplex.mainjob.config import MainJobConfig, RunEntry
from rlplex.models.spec import ModelSpec
from rlplex.multirun.orchestrator.config import OrchestratorConfig
from rlplex.tasks.registry import check_environment

FLOAT32_BYTES = 4
# LoRA weights, their gradients and Adam's two moments, all float32.
LORA_COPIES = 4
GIB = 1 << 30


class JobProblemsError(ConfigError):
    """Every problem found in a main job before it starts; the CLI prints one line for each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ModelShape:
    """What the memory bounds need of a causal LM, from its config.json."""

    hidden: int
    intermediate: int
    layers: int
    vocab: int
    max_positions: int

    @property
    def parameters(self) -> int:
        per_layer = 4 * self.hidden * self.hidden + 3 * self.hidden * self.intermediate
        return self.layers * per_layer + self.vocab * self.hidden

    def lora_floats_per_rank(self, output_head: bool = False) -> int:
        """LoRA weights of one adapter of rank 1 on the attention and MLP projections (and on the
        output head, `lm_head`, when it is a target)."""
        head = self.hidden + self.vocab if output_head else 0
        return self.layers * (4 * 2 * self.hidden + 3 * (self.hidden + self.intermediate)) + head


def model_shape(spec: ModelSpec) -> ModelShape | None:
    """The shape of `spec` from its config (None: a config without the usual fields).

    A local folder's config.json that names the fields is read as JSON: `AutoConfig` imports
    torch and every model's configuration (about 2 s of a `rlplex check`). Other configs (a hub
    id, a model whose fields have other names that its config class maps) go through `AutoConfig`."""
    if (fields := spec.local_config()) is not None and (shape := _shape_of(fields.get)) is not None:
        return shape
    from transformers import AutoConfig

    from rlplex.models.hf import _from_pretrained

    config: Any = _from_pretrained(AutoConfig, spec, "config")
    return _shape_of(lambda name: getattr(config, name, None))  # the class's attribute_map applies


def _shape_of(field: Callable[[str], Any]) -> ModelShape | None:
    try:
        hidden = int(field("hidden_size"))
        return ModelShape(
            hidden=hidden,
            intermediate=int(field("intermediate_size") or 4 * hidden),
            layers=int(field("num_hidden_layers")),
            vocab=int(field("vocab_size")),
            max_positions=int(field("max_position_embeddings") or 2048),
        )
    except (TypeError, ValueError):
        return None


def available_bytes(spec: ModelSpec) -> tuple[int, str]:
    """Memory of the device the job's model runs on: the GPU's on CUDA, else the machine's RAM."""
    if spec.device != "cpu" and cuda_present():  # no NVIDIA device node: no CUDA, and no torch import
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory), "GPU memory"
    import psutil

    return int(psutil.virtual_memory().total), "memory"


def run_problems(entry: RunEntry, job: MainJobConfig, source: str) -> list[str]:
    """What would stop this run, one line per problem: its environment (data and reward), and
    what the trainer would reject it for (the trainer's own rules)."""
    where = f"{source}: run {entry.id!r}"
    try:
        config: OrchestratorConfig = entry.orch_config(source)
    except RlplexError as error:
        return [str(error)]
    problems = []
    evaluation = config.evaluation.env_spec(config.env) if config.evaluation is not None else None
    for env, field in ((config.env, "env"), (evaluation, "evaluation")):
        if env is not None:
            try:
                check_environment(env)
            except RlplexError as error:
                problems.append(f"{where}: {field}: {error}")
    if config.model.lora.rank > job.trainer.max_lora_rank:
        problems.append(
            f"{where}: field 'model.lora.rank': {config.model.lora.rank} is more than trainer.max_lora_rank "
            f"{job.trainer.max_lora_rank}: the trainer would reject it"
        )
    if config.model.identity() != job.model.identity():
        problems.append(
            f"{where}: field 'model.name': {config.model.name!r} is not the job's model {job.model.name!r}: "
            "every run trains an adapter of the one shared base model"
        )
    if config.max_async_level > job.trainer.max_off_policy_steps:
        problems.append(
            f"{where}: field 'max_async_level': {config.max_async_level} is more than "
            f"trainer.max_off_policy_steps {job.trainer.max_off_policy_steps}: the trainer would reject it"
        )
    return problems


def memory_problems(job: MainJobConfig, shape: ModelShape, budget: int, what: str, source: str) -> list[str]:
    """Sizes that cannot fit in `budget` bytes: the trainer's adapter slots, and each run's batch."""
    problems = []
    trainer = job.trainer
    per_rank = shape.lora_floats_per_rank(output_head="lm_head" in (trainer.target_modules or ()))
    lora = trainer.max_runs * trainer.max_lora_rank * per_rank * FLOAT32_BYTES * LORA_COPIES
    base = shape.parameters * FLOAT32_BYTES
    if trainer.world_size * (base + lora) > budget:
        problems.append(
            f"{source}: field 'trainer.max_runs': {trainer.max_runs} adapter slots of rank {trainer.max_lora_rank} "
            f"on {trainer.world_size} rank(s) need at least {_gib(trainer.world_size * (base + lora))}; "
            f"this machine has {_gib(budget)} of {what}"
        )
    for entry in job.runs + job.later_runs:
        try:
            config = entry.orch_config(source)
        except RlplexError:
            continue  # reported by run_problems
        length = min(shape.max_positions, 64 + (config.max_new_tokens or 64))
        # One generation pass over the whole batch: its KV cache and the last position's logits.
        kv = config.batch_size * length * shape.layers * 2 * shape.hidden * FLOAT32_BYTES
        logits = config.batch_size * shape.vocab * FLOAT32_BYTES
        if base + kv + logits > budget:
            problems.append(
                f"{source}: run {entry.id!r}: field 'batch_size': {config.batch_size} samples of up to {length} "
                f"tokens need at least {_gib(base + kv + logits)} to generate; this machine has {_gib(budget)} "
                f"of {what}"
            )
    return problems


def _gib(value: float) -> str:
    return f"{value / GIB:,.1f} GiB"


def check_main_job(job: MainJobConfig, source: str) -> None:
    """Raise one `ConfigError` listing every problem of `job` found without starting anything."""
    problems = [line for entry in job.runs + job.later_runs for line in run_problems(entry, job, source)]
    shape = model_shape(job.model)
    if shape is not None:
        budget, what = available_bytes(job.model)
        problems += memory_problems(job, shape, budget, what, source)
    if problems:
        raise JobProblemsError(problems)
