"""`rlplex export`: a run's newest adapter as a folder other tools load.

The trainer broadcasts every step's adapter in PEFT's layout (`broadcast/step_N`, see
`rundir.peft_export`), so an export is that folder taken whole (its STABLE marker says so),
copied out of the run with the base model's tokenizer beside it: `PeftModel.from_pretrained`
(or `AutoPeftModelForCausalLM`) and `AutoTokenizer` load it. With `merge`, the adapter is added
into the base weights (W + alpha/r * B A, the transpose for GPT-2's Conv1D) and the result is a
plain `save_pretrained` folder: `AutoModelForCausalLM.from_pretrained` loads it without peft.

The run's folder is a trust boundary: its files are read through `rlplex.io.safe_files` (regular
files, size-capped, no link out of the run), its config through the guarded `orch.toml` reader,
and nothing in it is unpickled. The destination is assembled in a hidden sibling and renamed
into place, so a failed export leaves no half folder where the user looks.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlplex.errors import AdapterError, ExportError, RlplexError
from rlplex.io.safe_files import read_regular_file
from rlplex.multirun.orchestrator.config import read_orch_config
from rlplex.multirun.rundir import RUN_PREFIX, stable_steps
from rlplex.multirun.rundir.peft_export import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    check_stable_adapter,
    read_peft_adapter,
)


@dataclass(frozen=True)
class ExportResult:
    run_id: str
    step: int
    source: Path
    dest: Path
    merged: bool


def find_run_folder(out: Path, run_id: str) -> Path:
    """The folder of `run_id` in a main job's folder (`runs/<id>`) or a trainer's output folder."""
    if not out.is_dir():
        raise ExportError(f"{out}: no such folder (give a main job's or a trainer's output folder)")
    names = [run_id] if run_id.startswith(RUN_PREFIX) else [run_id, RUN_PREFIX + run_id]
    parents = [out / "runs", out]
    for parent in parents:
        for name in names:
            folder = parent / name
            if folder.is_dir() and not folder.is_symlink() and (folder / "control").is_dir():
                return folder
    known = sorted(
        {p.name for parent in parents if parent.is_dir() for p in parent.iterdir() if (p / "control").is_dir()}
    )
    listed = ", ".join(known) if known else "none"
    raise ExportError(f"{out}: no run {run_id!r} (runs there: {listed})")


def _adapter_step(run_folder: Path, step: int | None) -> tuple[int, Path]:
    broadcasts = stable_steps(run_folder / "broadcast")
    if not broadcasts:
        raise ExportError(f"{run_folder / 'broadcast'}: no complete adapter yet (the run has not trained a step)")
    if step is None:
        return broadcasts[-1]
    for found, path in broadcasts:
        if found == step:
            return found, path
    have = ", ".join(str(s) for s, _ in broadcasts)
    raise ExportError(f"{run_folder / 'broadcast'}: no complete adapter of step {step} (steps there: {have})")


def _adapter_config(adapter: Path, within: Path) -> dict[str, Any]:
    path = adapter / ADAPTER_CONFIG
    try:
        config = json.loads(read_regular_file(path, within=within))
    except (OSError, ValueError) as error:
        raise ExportError(f"{path}: unreadable adapter config ({error})") from None
    rank, alpha = (config.get(key) if isinstance(config, dict) else None for key in ("r", "lora_alpha"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float) or alpha <= 0:
        raise ExportError(f"{path}: field 'r' or 'lora_alpha' is not a positive number (r={rank!r}, alpha={alpha!r})")
    return dict(config)


def _fresh_destination(dest: Path) -> Path:
    if os.path.lexists(dest) and not (dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir())):
        raise ExportError(f"{dest}: already exists and is not an empty folder; name a new one")
    if not dest.parent.is_dir():
        raise ExportError(f"{dest.parent}: no such folder")
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def merge_adapter(model: Any, adapter: dict[str, Any], scaling: float) -> int:
    """Add `scaling * B @ A` of every adapted module into `model`'s weights; return how many.

    `adapter` maps module names (`model.layers.0.self_attn.q_proj.lora_A.weight`) to tensors,
    as `read_peft_adapter` gives them."""
    import torch

    from rlplex.multirun.trainer.lora import is_conv1d

    modules = sorted(name.removesuffix(".lora_A.weight") for name in adapter if name.endswith(".lora_A.weight"))
    for name in modules:
        try:
            layer = model.get_submodule(name)
        except AttributeError:
            raise AdapterError(f"adapter module {name!r} is not in the base model") from None
        a, b = adapter[f"{name}.lora_A.weight"], adapter[f"{name}.lora_B.weight"]
        delta = scaling * (b.to(torch.float32) @ a.to(torch.float32))
        if _shares_input_embeddings(model, layer):
            # A tied output head (`lm_head` a target): merged in place, the delta would change the
            # input embeddings too. The merged model gets a head of its own and says so in its config.
            layer.weight = torch.nn.Parameter(layer.weight.detach().clone())
            model.config.tie_word_embeddings = False
        weight = layer.weight
        if is_conv1d(layer):  # Conv1D keeps W as [in, out]
            delta = delta.T
        if tuple(delta.shape) != tuple(weight.shape):
            raise AdapterError(
                f"adapter module {name!r}: B @ A has shape {tuple(delta.shape)}, the weight {tuple(weight.shape)}"
            )
        with torch.no_grad():
            weight.copy_((weight.to(torch.float32) + delta.to(weight.device)).to(weight.dtype))
    return len(modules)


def _shares_input_embeddings(model: Any, layer: Any) -> bool:
    get_input_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_input_embeddings() if callable(get_input_embeddings) else None
    return embeddings is not None and getattr(embeddings, "weight", None) is layer.weight


def export_run(out: Path, run_id: str, dest: Path, *, merge: bool = False, step: int | None = None) -> ExportResult:
    """Write run `run_id`'s newest complete adapter (or that of `step`) to `dest` (see the module doc)."""
    from rlplex.models.hf import load_causal_lm, load_tokenizer
    from rlplex.models.spec import ModelSpec

    run_folder = find_run_folder(out, run_id)
    found, adapter = _adapter_step(run_folder, step)
    check_stable_adapter(adapter, within=run_folder)
    config = read_orch_config(run_folder / "control" / "orch.toml", within=run_folder)
    spec = ModelSpec.model_validate(config.model.model_dump(exclude={"lora"}))
    adapter_config = _adapter_config(adapter, run_folder)
    tensors = read_peft_adapter(adapter, within=run_folder)
    tmp = _fresh_destination(dest)
    try:
        if merge:
            import torch

            model = load_causal_lm(spec, torch.device("cpu"))
            merge_adapter(model, tensors, adapter_config["lora_alpha"] / adapter_config["r"])
            model.save_pretrained(tmp)
        else:
            for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
                (tmp / name).write_bytes(read_regular_file(adapter / name, 1 << 36, within=run_folder))
        load_tokenizer(spec).save_pretrained(tmp)
        if os.path.lexists(dest):
            dest.rmdir()  # the empty folder _fresh_destination allowed
        tmp.rename(dest)
    except (OSError, RlplexError) as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, ExportError | AdapterError):
            raise
        raise ExportError(f"{dest}: export of {run_folder.name} step {found} failed ({error})") from error
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(run_folder.name, found, adapter, dest, merge)


__all__ = ["ExportResult", "export_run", "find_run_folder", "merge_adapter"]
