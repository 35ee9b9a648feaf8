"""Iteration snapshots: safetensors for every tensor and array, JSON for the rest; no pickle.

A snapshot is a directory `itr_N/` with `tensors.safetensors` and `state.json`. It is
written into a temporary sibling and renamed into place, so a crash leaves either the old
snapshot or the new one, never half of one. Nested state (optimizer state dicts, RNG
states, replay buffers) is encoded generically: tensors and arrays go to safetensors under
a path-like key and the JSON skeleton keeps a reference to them, preserving int dict keys.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from rlplex.errors import SnapshotError
from rlplex.io.safe_files import check_regular_file, read_regular_file

SnapshotMode = Literal["last", "all", "gap", "none"]
_PREFIX = "itr_"
MAX_SNAPSHOT_BYTES = 1 << 40


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().cpu().contiguous().clone()
        return {"__tensor__": path}
    if isinstance(obj, np.ndarray):
        tensors[path] = torch.from_numpy(np.ascontiguousarray(obj).copy())
        return {"__ndarray__": path}
    if isinstance(obj, dict):
        items = []
        for key, value in obj.items():
            if not isinstance(key, str | int):
                raise SnapshotError(f"cannot snapshot a dict key of type {type(key).__name__} at {path}")
            items.append([key, _encode(value, f"{path}.{key}", tensors)])
        return {"__dict__": items}
    if isinstance(obj, list | tuple):
        encoded = [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
        return {"__tuple__": encoded} if isinstance(obj, tuple) else encoded
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise SnapshotError(f"cannot snapshot a value of type {type(obj).__name__} at {path}")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__ndarray__" in obj:
            return tensors[obj["__ndarray__"]].numpy()
        if "__tuple__" in obj:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
        if "__dict__" in obj:
            return {key: _decode(value, tensors) for key, value in obj["__dict__"]}
    return obj


def write_snapshot_into(directory: Path, state: dict[str, Any]) -> None:
    """Write the snapshot files of `state` into `directory`, which must already exist.

    Not atomic by itself: callers write into a temporary directory and rename it, as
    `write_snapshot` does (the multi-run checkpoints create that directory themselves so that
    a deleted run directory is never recreated).
    """
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, "s", tensors)
    save_file(tensors, str(directory / "tensors.safetensors"))
    fd = os.open(directory / "tensors.safetensors", os.O_RDONLY)
    try:
        os.fsync(fd)  # safetensors does not: a power cut could leave a STABLE-marked empty file
    finally:
        os.close(fd)
    with (directory / "state.json").open("w") as handle:
        json.dump(skeleton, handle)
        handle.flush()
        os.fsync(handle.fileno())


def write_snapshot(directory: Path, state: dict[str, Any]) -> None:
    """Write `state` atomically as directory `directory` (replaced if it exists)."""
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_snapshot_into(tmp, state)
    old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
    if directory.exists():
        directory.rename(old)
    tmp.rename(directory)
    shutil.rmtree(old, ignore_errors=True)


def read_snapshot(directory: str | Path) -> dict[str, Any]:
    directory = Path(directory)
    try:
        # A snapshot folder may come from anywhere: no FIFO, device or link is opened as one.
        check_regular_file(directory / "tensors.safetensors", MAX_SNAPSHOT_BYTES)
        tensors = load_file(str(directory / "tensors.safetensors"))
        skeleton = json.loads(read_regular_file(directory / "state.json", MAX_SNAPSHOT_BYTES))
    except FileNotFoundError as error:
        raise SnapshotError(f"{directory}: not a snapshot ({error.filename} missing)") from None
    except (OSError, ValueError, SafetensorError) as error:
        raise SnapshotError(f"{directory}: snapshot is unreadable or corrupt: {error}") from None
    try:
        state = _decode(skeleton, tensors)
    except KeyError as error:
        raise SnapshotError(f"{directory}: snapshot refers to a missing tensor {error}") from None
    if not isinstance(state, dict):
        raise SnapshotError(f"{directory}: snapshot root is not a mapping")
    return state


def snapshot_path(snapshot_dir: Path, itr: int) -> Path:
    return snapshot_dir / f"{_PREFIX}{itr}"


def list_snapshots(snapshot_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete snapshots (temporaries excluded), oldest first."""
    snapshot_dir = Path(snapshot_dir)
    if not snapshot_dir.is_dir():
        return []
    found = []
    for entry in snapshot_dir.iterdir():
        suffix = entry.name[len(_PREFIX) :]
        if entry.name.startswith(_PREFIX) and suffix.isdigit() and (entry / "state.json").exists():
            found.append((int(suffix), entry))
    return sorted(found)


def latest_snapshot(snapshot_dir: str | Path) -> Path:
    found = list_snapshots(snapshot_dir)
    if not found:
        raise SnapshotError(f"{snapshot_dir}: no snapshot to resume from")
    return found[-1][1]


def save_by_mode(snapshot_dir: Path, itr: int, state: dict[str, Any], mode: SnapshotMode, gap: int) -> Path | None:
    """Write the snapshot of `itr` if `mode` asks for it; with "last", older ones are removed after.

    "gap" writes after every `gap`-th iteration (`itr` counts from 0): runners offer a snapshot
    at each log row, after iteration k * log_interval - 1, so a gap equal to the log interval
    writes at every row."""
    if mode == "none" or (mode == "gap" and (itr + 1) % gap != 0):
        return None
    path = snapshot_path(snapshot_dir, itr)
    write_snapshot(path, state)
    if mode == "last":
        for old_itr, old_path in list_snapshots(snapshot_dir):
            if old_itr != itr:
                shutil.rmtree(old_path, ignore_errors=True)
    return path


def schedule_itrs(schedule_steps: int | None, n_steps: int, itr_batch_size: int) -> int:
    """Iterations over which an algorithm's linear schedules run: `schedule_steps` if given, else `n_steps`."""
    return max(1, -(-(schedule_steps or n_steps) // itr_batch_size))


def resumed_schedule_itrs(state: dict[str, Any], current: int, given: bool) -> int:
    """The schedule horizon of a resumed run: the snapshot's, unless the user gave a new one.

    A resume with a larger `n_steps` extends the run, not its schedules: were the horizon the
    new `n_steps`, a linearly decayed learning rate would jump back up. Snapshots from before
    the horizon was recorded keep the old behaviour (the current `n_steps`).
    """
    if given or "schedule_itrs" not in state:
        return current
    return int(state["schedule_itrs"])


def set_cuda_rng_states(states: list[torch.Tensor]) -> None:
    """Restore the GPUs' generators that a snapshot holds and this machine has (a snapshot
    taken on more GPUs, or on a GPU and resumed on the CPU, restores what fits)."""
    if not states or not torch.cuda.is_available():
        return
    for index, state in enumerate(states[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(state, index)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_initialized():  # a model on a GPU draws its actions there
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    set_cuda_rng_states(state.get("torch_cuda", []))
    np.random.set_state(state["numpy"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def check_compatible(model_state: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], source: Path) -> None:
    """Refuse a snapshot whose parameters do not fit the model built from the current config."""
    missing = sorted(set(model_state) - set(saved))
    extra = sorted(set(saved) - set(model_state))
    if missing or extra:
        raise SnapshotError(
            f"{source}: snapshot is from an incompatible config: "
            f"missing parameters {missing[:5]}, unexpected parameters {extra[:5]}"
        )
    for key, tensor in model_state.items():
        if tuple(saved[key].shape) != tuple(tensor.shape):
            raise SnapshotError(
                f"{source}: snapshot is from an incompatible config: parameter {key!r} has shape "
                f"{tuple(saved[key].shape)} in the snapshot but {tuple(tensor.shape)} in the model"
            )


def algo_name(algo: Any) -> str:
    return str(getattr(algo, "name", type(algo).__name__))


def check_same_algo(state: dict[str, Any], algo: Any, source: str | Path) -> None:
    """Refuse a snapshot written by another algorithm (one from before names were recorded passes)."""
    saved = state.get("algo_name")
    if saved is not None and saved != algo_name(algo):
        raise SnapshotError(
            f"{source}: snapshot was written by {saved}, this run trains {algo_name(algo)}; "
            "resume it with the config it was written with"
        )
