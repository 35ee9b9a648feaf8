"""Which run each orchestrator node serves, and requests to change that from another shell.

`runs.json` in the job's output folder is the list of runs in the order they joined: node
`rank` of the orchestrator role serves entry `rank`, so adding a run is appending an entry
and scaling the role by one. A run whose config asks for `rollout_workers = N > 1` generates on
N nodes of the `rollout` role, numbered in the same order (`rollout_slots`), so its nodes too are
appended when it joins. Only the master process writes it (atomically); anyone else
asks through `requests/`: `rlplex runs add` drops a JSON file there, the master's loop
accepts it (appends, scales) or rejects it with the reason next to it. Everything is JSON:
these files cross a trust boundary.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from rlplex.errors import ConfigError, WaitTimeoutError
from rlplex.io.safe_files import read_regular_text, write_file_atomic
from rlplex.mainjob.config import RunEntry

REGISTRY_FILE = "runs.json"
REQUESTS_DIR = "requests"
REJECTIONS_DIR = "rejected"  # a run's user error, final for that run: `<run id>.txt` holds the reason
MAX_REQUEST_BYTES = 1_000_000


def read_registry(output_dir: Path) -> list[RunEntry]:
    path = output_dir / REGISTRY_FILE
    try:
        # A FIFO or a link to a device here would freeze the master's loop and `rlplex status`.
        data = json.loads(read_regular_text(path, MAX_REQUEST_BYTES * 64))
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: unreadable run registry ({error})") from None
    if not isinstance(data, list):
        raise ConfigError(f"{path}: expected a JSON list of runs, got {type(data).__name__}")
    entries = []
    for number, item in enumerate(data):
        try:
            entries.append(RunEntry.model_validate(item))
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "<entry>"
            raise ConfigError(f"{path}: entry {number}, field {where!r}: {first['msg']}") from None
    return entries


def write_registry(output_dir: Path, entries: list[RunEntry]) -> None:
    data = json.dumps([entry.model_dump(mode="json") for entry in entries], indent=1)
    write_file_atomic(output_dir / REGISTRY_FILE, data.encode())


def run_for_rank(output_dir: Path, rank: int) -> RunEntry:
    entries = read_registry(output_dir)
    if not 0 <= rank < len(entries):
        raise ConfigError(f"{output_dir / REGISTRY_FILE}: no run for orchestrator rank {rank} ({len(entries)} runs)")
    return entries[rank]


def rollout_slots(entries: list[RunEntry]) -> list[str]:
    """The run that node `rank` of the `rollout` role generates for, for each rank in order."""
    slots: list[str] = []
    for entry in entries:
        workers = entry.orch_config(REGISTRY_FILE).rollout_workers
        if workers > 1:  # 1: the run generates in its orchestrator's own process
            slots += [entry.id] * workers
    return slots


def rollout_ranks(output_dir: Path, run_id: str) -> list[int]:
    return [rank for rank, run in enumerate(rollout_slots(read_registry(output_dir))) if run == run_id]


@dataclass(frozen=True)
class AddRequest:
    path: Path
    entry: RunEntry


def duplicate_run(run_id: str) -> str:
    return f"run {run_id!r} is already in the job; add it under another --id"


def submit_add(output_dir: Path, entry: RunEntry) -> Path:
    """Ask the running job to add `entry`; returns the request file (see `wait_for_answer`)."""
    if not (output_dir / REGISTRY_FILE).exists():
        raise ConfigError(f"{output_dir}: no main job here ({REGISTRY_FILE} missing)")
    if entry.id in {e.id for e in read_registry(output_dir)}:  # said at once; the master checks again
        raise ConfigError(f"{output_dir}: {duplicate_run(entry.id)}")
    requests = output_dir / REQUESTS_DIR
    requests.mkdir(exist_ok=True)
    path = requests / f"add-{time.time_ns()}-{uuid.uuid4().hex[:6]}.json"
    write_file_atomic(path, json.dumps(entry.model_dump(mode="json")).encode())
    return path


def pending_requests(output_dir: Path) -> list[AddRequest | tuple[Path, str]]:
    """Add requests in arrival order; unreadable ones come back as (path, reason)."""
    requests = output_dir / REQUESTS_DIR
    if not requests.is_dir():
        return []
    out: list[AddRequest | tuple[Path, str]] = []
    for path in sorted(requests.glob("add-*.json")):
        try:
            text = read_regular_text(path, MAX_REQUEST_BYTES)  # a FIFO here must not freeze the master
            out.append(AddRequest(path, RunEntry.model_validate(json.loads(text))))
        except (OSError, ValueError) as error:  # pydantic's ValidationError is a ValueError
            out.append((path, f"{path}: malformed request: {error}"))
    return out


def answer(request: Path, accepted: bool, text: str) -> None:
    """Close a request: `<name>.accepted` or `<name>.rejected` holds the answer; the request goes."""
    suffix = ".accepted" if accepted else ".rejected"
    write_file_atomic(request.with_suffix(suffix), text.encode())
    try:
        os.unlink(request)
    except FileNotFoundError:
        pass


def wait_for_answer(request: Path, timeout_s: float) -> tuple[bool, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for accepted, suffix in ((True, ".accepted"), (False, ".rejected")):
            reply = request.with_suffix(suffix)
            if reply.exists():
                try:
                    return accepted, read_regular_text(reply, MAX_REQUEST_BYTES)
                except OSError as error:
                    raise ConfigError(f"{reply}: unreadable answer ({error})") from None
        time.sleep(0.1)
    raise WaitTimeoutError(f"{request}: no answer from the job's master within {timeout_s:g} s (is it running?)")


def write_rejection(output_dir: Path, run_id: str, reason: str) -> None:
    folder = output_dir / REJECTIONS_DIR
    folder.mkdir(exist_ok=True)
    write_file_atomic(folder / f"{run_id}.txt", (reason.strip() + "\n").encode())


def rejection_reason(output_dir: Path, run_id: str) -> str | None:
    """Why the job's orchestrator node rejected `run_id` (None: it did not)."""
    path = output_dir / REJECTIONS_DIR / f"{run_id}.txt"
    try:
        return read_regular_text(path, within=output_dir / REJECTIONS_DIR).strip()
    except FileNotFoundError:
        return None
    except OSError as error:
        return f"({path} unreadable: {error})"
