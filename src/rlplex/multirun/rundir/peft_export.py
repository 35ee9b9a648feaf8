"""Write one run's adapter as a PEFT LoRA folder that ``peft.PeftModel.from_pretrained`` loads.

Layout (as ``PeftModel.save_pretrained`` writes it for peft 0.21)::

    directory/
      adapter_model.safetensors   keys base_model.model.<module>.lora_A.weight [r, in]
                                       base_model.model.<module>.lora_B.weight [out, r]
      adapter_config.json         peft_type LORA, r, lora_alpha, target_modules, ...
      STABLE                      written last: readers take only folders that have it

The folder is assembled in a hidden sibling and renamed into place, so a reader never sees
half an adapter; STABLE comes after the rename. Only the immediate parent (``broadcast/``)
is created, never a deleted run directory above it. peft is not imported: it is a dev
dependency, and the inference side may be another tool that reads the same layout.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file

from rlplex.errors import AdapterError, UnsafeFileError
from rlplex.io.safe_files import SMALL_FILE_BYTES, check_regular_file, fsync_dir, read_regular_file

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_PROGRESS = "trainer_progress.json"
"""The trainer's progress when it wrote the adapter (a resume starts from the newest one)."""
MAX_ADAPTER_BYTES = 1 << 36
STABLE_MARKER = "STABLE"
PEFT_PREFIX = "base_model.model."
_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def peft_key(name: str) -> str:
    """``model.layers.0.self_attn.q_proj.lora_A.weight`` -> the key peft stores it under."""
    return name if name.startswith(PEFT_PREFIX) else PEFT_PREFIX + name


def _base_model_name(base: Any) -> str | None:
    if base is None or isinstance(base, str | os.PathLike):
        return None if base is None else str(base)
    name = getattr(base, "name_or_path", None)  # a transformers PretrainedConfig
    return str(name) if name else None


def _checked_tensors(adapter_state: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    if not adapter_state:
        raise AdapterError("adapter_state is empty: nothing to export")
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in adapter_state.items():
        if not name.endswith(_SUFFIXES):
            raise AdapterError(f"adapter_state key {name!r}: expected a name ending in {' or '.join(_SUFFIXES)}")
        is_a = name.endswith(_SUFFIXES[0])
        if tensor.dim() != 2 or tensor.shape[0 if is_a else 1] != rank:
            raise AdapterError(f"adapter_state[{name!r}] has shape {tuple(tensor.shape)}, which is not of rank {rank}")
        if not torch.isfinite(tensor).all():
            raise AdapterError(f"adapter_state[{name!r}] holds NaN or inf values")
        tensors[peft_key(name)] = tensor.detach().to("cpu").contiguous().clone()
    modules = {key[: -len(_SUFFIXES[0])] for key in tensors if key.endswith(_SUFFIXES[0])}
    modules_b = {key[: -len(_SUFFIXES[1])] for key in tensors if key.endswith(_SUFFIXES[1])}
    if modules != modules_b:
        raise AdapterError(f"adapter_state: modules without both lora_A and lora_B: {sorted(modules ^ modules_b)}")
    return tensors


def peft_adapter_config(
    base_model_name_or_config: Any,
    rank: int,
    alpha: float,
    target_modules: Iterable[str],
    task_type: str | None = None,
    *,
    fan_in_fan_out: bool = False,
) -> dict[str, Any]:
    """The ``adapter_config.json`` fields a plain LoRA needs; peft fills the rest with defaults.

    ``fan_in_fan_out`` must be True when the targets are GPT-2 style Conv1D layers (weight stored
    [in, out]): peft forces it to that value per layer type and warns when the file disagrees;
    ``MultiLoRAModules.fan_in_fan_out`` says which. The LoRA tensors are the same either way.
    """
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": _base_model_name(base_model_name_or_config),
        "revision": None,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(set(target_modules)),
        "bias": "none",
        "fan_in_fan_out": fan_in_fan_out,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_peft_adapter(
    directory: str | Path,
    adapter_state: dict[str, torch.Tensor],
    base_model_name_or_config: Any,
    rank: int,
    alpha: float,
    target_modules: Iterable[str],
    task_type: str | None = None,
    *,
    fan_in_fan_out: bool = False,
    progress: dict[str, int] | None = None,
) -> Path:
    """Write ``directory`` as a STABLE PEFT LoRA adapter (replacing it if present); return it.

    ``progress``: the trainer's counters at this adapter, written beside it (peft and vLLM
    ignore the file) so that a resume can start from the newest adapter.

    ``adapter_state`` maps model module names (``model.layers.0.self_attn.q_proj.lora_A.weight``,
    with or without the ``base_model.model.`` prefix) to tensors of the run's real ``rank``.
    ``fan_in_fan_out``: True for GPT-2 Conv1D targets (see ``peft_adapter_config``).
    """
    directory = Path(directory)
    tensors = _checked_tensors(adapter_state, rank)
    config = peft_adapter_config(
        base_model_name_or_config, rank, alpha, target_modules, task_type, fan_in_fan_out=fan_in_fan_out
    )
    try:
        directory.parent.mkdir(exist_ok=True)  # one level only: never recreate a deleted run directory
    except FileNotFoundError:
        raise AdapterError(
            f"{directory}: parent {directory.parent.parent} no longer exists; adapter not written"
        ) from None
    except FileExistsError:  # mkdir(exist_ok=True) raises this only when the path is not a directory
        raise AdapterError(f"{directory}: {directory.parent} is not a directory; adapter not written") from None
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with (tmp / ADAPTER_WEIGHTS).open("rb") as handle:
            os.fsync(handle.fileno())
        _write_synced(tmp / ADAPTER_CONFIG, json.dumps(config, indent=2).encode())
        if progress is not None:
            _write_synced(tmp / ADAPTER_PROGRESS, json.dumps(progress).encode())
        if os.path.lexists(directory):  # a symlink there (dangling too) is moved aside, never followed
            directory.rename(old)
        tmp.rename(directory)
        _write_synced(directory / STABLE_MARKER, b"")
        fsync_dir(directory.parent)
    except (OSError, SafetensorError) as error:  # safetensors reports a full disk as its own error
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.lexists(old) and not os.path.lexists(directory):
            old.rename(directory)  # the previous adapter stays the one readers see
        raise AdapterError(f"{directory}: adapter not written ({error})") from error
    if os.path.islink(old):
        os.unlink(old)  # rmtree refuses a link, and must never go through one
    else:
        shutil.rmtree(old, ignore_errors=True)
    return directory


def stable_adapter_problem(directory: str | Path, within: Path | None = None) -> str | None:
    """Why `directory` is not an adapter readers may take, or None.

    A reader takes a real folder (not a symlink: a `broadcast/step_N` linked to another run's
    adapter would have this run sample with that run's weights) whose STABLE marker and weights
    are regular files, reached through no folder that leads out of `within` (the run's folder).
    """
    directory = Path(directory)
    try:
        mode = os.lstat(directory).st_mode
        if stat.S_ISLNK(mode):
            return "is a symlink (an adapter folder must be a real folder inside the run)"
        if not stat.S_ISDIR(mode):
            return "is not a folder"
        check_regular_file(directory / STABLE_MARKER, SMALL_FILE_BYTES, within)
        check_regular_file(directory / ADAPTER_WEIGHTS, MAX_ADAPTER_BYTES, within)
    except OSError as error:  # UnsafeFileError included: it names the file and the fault
        return str(error) if isinstance(error, UnsafeFileError) else f"{error.filename}: {error.strerror}"
    return None


def is_stable_adapter(directory: str | Path, within: Path | None = None) -> bool:
    """True when `directory` is a complete adapter readers may take (see `stable_adapter_problem`)."""
    return stable_adapter_problem(directory, within) is None


def check_stable_adapter(directory: str | Path, within: Path | None = None) -> Path:
    """`directory`, or `AdapterError` naming it and why it may not be loaded."""
    problem = stable_adapter_problem(directory, within)
    if problem is not None:
        raise AdapterError(f"{directory}: not loaded: {problem}")
    return Path(directory)


def read_peft_adapter(directory: str | Path, within: Path | None = None) -> dict[str, torch.Tensor]:
    """The adapter tensors of a folder `write_peft_adapter` wrote, keyed by module names (no peft prefix)."""
    path = Path(directory) / ADAPTER_WEIGHTS
    try:
        tensors = load_safetensors(read_regular_file(path, MAX_ADAPTER_BYTES, within))
    except (OSError, SafetensorError) as error:
        raise AdapterError(f"{path}: unreadable adapter ({error})") from None
    return {key.removeprefix(PEFT_PREFIX): tensor for key, tensor in tensors.items()}


def read_adapter_progress(directory: str | Path, within: Path | None = None) -> dict[str, int] | None:
    """The trainer's counters stored beside an adapter (None: no such file, or unreadable)."""
    try:
        record = json.loads(read_regular_file(Path(directory) / ADAPTER_PROGRESS, within=within))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not all(isinstance(v, int) for v in record.values()):
        return None
    return record
