"""The shared frozen base model of a multi-run job: the tiny LM after its supervised warm-up.

`base_model(config, output_dir)` is what the trainer and every orchestrator call. It is a pure
function of `config.task` and `config.model.base` (architecture, seed, warm-up steps, batch,
learning rate): `build_tiny_lm(TinyLMConfig(...))`, then the deterministic `supervised_warmup`
on the task. The result is cached at ``output_dir/base_model/<key>.safetensors``:

- `<key>` = `base_model_key(config)`, a hash of exactly those fields, so two runs agree on
  the base iff their keys agree (the trainer can reject a run whose key differs from its own);
- the first process to need a key takes an exclusive `flock` on ``<key>.lock``, warms up and
  writes the file atomically (temporary file, fsync, rename); the others block on the lock and
  then load the file, so every process gets bit-identical weights and the warm-up runs once;
- a cache file that cannot be loaded is rebuilt (with a warning) instead of trusted.

The file is a plain safetensors state dict without the tied ``lm_head.weight``, the layout
`rlplex.multirun.trainer.TrainerConfig.base_model` loads: a trainer for these runs takes
``base_model=base_model_path(config, output_dir)`` and ``model=tiny_lm_config(config)`` after
calling `base_model(config, output_dir)` once. The cache lives beside the `run_*`
directories; the run scanner ignores it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from rlplex.models.lm import TinyLMConfig, build_tiny_lm, supervised_warmup
from rlplex.multirun.orch_config import OrchestratorConfig
from rlplex.tasks import CharTokenizer, get_task

log = logging.getLogger(__name__)

BASE_MODEL_DIR = "base_model"
_FORMAT_VERSION = 1  # bump when the meaning of the cached weights changes
_TIED = "lm_head.weight"


def tiny_lm_config(config: OrchestratorConfig) -> TinyLMConfig:
    base = config.model.base
    return TinyLMConfig(**{name: getattr(base, name) for name in TinyLMConfig.model_fields})


def base_model_key(config: OrchestratorConfig) -> str:
    """16 hex digits identifying the base weights: task + `model.base`, nothing else."""
    payload = {"format": _FORMAT_VERSION, "task": config.task, "base": config.model.base.model_dump()}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def base_model_path(config: OrchestratorConfig, output_dir: str | Path) -> Path:
    return Path(output_dir) / BASE_MODEL_DIR / f"{base_model_key(config)}.safetensors"


def build_base_model(config: OrchestratorConfig) -> LlamaForCausalLM:
    """Build and warm up the base model without the cache (what the cache file holds)."""
    base = config.model.base
    task = get_task(config.task)
    model = build_tiny_lm(tiny_lm_config(config))
    if base.warmup_steps:
        supervised_warmup(
            model,
            CharTokenizer(),
            task,
            steps=base.warmup_steps,
            batch_size=base.warmup_batch_size,
            lr=base.warmup_lr,
            seed=base.seed,
        )
    return model.eval()


def _try_load(model: LlamaForCausalLM, path: Path) -> bool:
    try:
        state = load_file(str(path))
        missing, unexpected = model.load_state_dict(state, strict=False)
    except (OSError, SafetensorError, RuntimeError, ValueError) as error:
        log.warning("base model cache %s cannot be loaded (%s); rebuilding it", path, error)
        return False
    if [k for k in missing if k != _TIED] or unexpected:
        log.warning("base model cache %s does not fit the model (missing %s, unexpected %s)", path, missing, unexpected)
        return False
    return True


def _save_atomic(model: LlamaForCausalLM, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        # A plain state dict without the tied lm_head (it shares the embedding's storage, which
        # safetensors refuses): the layout `TrainerConfig.base_model` loads too.
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != _TIED}
        save_file(state, str(tmp), metadata={"format": "pt"})
        with tmp.open("rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def base_model(config: OrchestratorConfig, output_dir: str | Path) -> LlamaForCausalLM:
    """The warmed-up base model for `config`, frozen and in eval mode, built once per output_dir."""
    path = base_model_path(config, output_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        try:
            if path.is_file():
                model = build_tiny_lm(tiny_lm_config(config))
                if _try_load(model, path):
                    return model.eval().requires_grad_(False)
            model = build_base_model(config)
            _save_atomic(model, path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return model.requires_grad_(False)


__all__ = ["base_model", "base_model_key", "base_model_path", "build_base_model", "tiny_lm_config"]
