"""`rlplex run`: start the main job under a PrimeMaster, keep the live view up, take add
requests, and write the report when the job ends (whatever way it ends)."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live

from rlplex.config import validate_config
from rlplex.control.master import PrimeMaster
from rlplex.control.states import TERMINAL_JOB_STATES, JobState
from rlplex.errors import ConfigError, RlplexError
from rlplex.inference.config import InferenceConfig
from rlplex.inference.vllm_server import ensure_api_key, require_vllm
from rlplex.mainjob.build import build_job_spec
from rlplex.mainjob.config import JOB_CONFIG_FILE, MainJobConfig
from rlplex.mainjob.registry import REGISTRY_FILE, answer, pending_requests, read_registry, write_registry
from rlplex.mainjob.report import write_report
from rlplex.mainjob.view import collect, render
from rlplex.models.spec import ModelSpec
from rlplex.multirun.rundir import write_file_atomic


def accept_requests(
    master: PrimeMaster,
    output_dir: Path,
    model: ModelSpec,
    inference: InferenceConfig | None = None,
    endpoint_dir: Path | None = None,
) -> list[str]:
    """Add the runs asked for since the last call (their model and engine fields filled from the
    job's); each request gets its answer file."""
    added = []
    for request in pending_requests(output_dir):
        if isinstance(request, tuple):
            answer(request[0], False, request[1])
            continue
        registry = read_registry(output_dir)
        entry = request.entry.with_model(model, inference, endpoint_dir)
        try:
            if entry.id in {e.id for e in registry}:
                raise ConfigError(f"{request.path}: run {entry.id!r} is already in the job")
            entry.orch_config(str(request.path))
        except RlplexError as error:
            answer(request.path, False, str(error))
            continue
        write_registry(output_dir, [*registry, entry])
        master.scale_role("orchestrator", len(registry) + 1)
        answer(request.path, True, f"{entry.id} added as orchestrator rank {len(registry)}")
        added.append(entry.id)
    return added


def check_model(config: MainJobConfig) -> None:
    """Load the job's tokenizer now: a model that cannot be found fails before any process starts."""
    from rlplex.models.hf import load_tokenizer, resolve_device

    resolve_device(config.model.device)
    load_tokenizer(config.model)
    if config.inference.engine == "vllm":
        require_vllm(config.model)


def read_job_model(output_dir: Path) -> ModelSpec | None:
    """The `[model]` of the main job in `output_dir`, or None when there is none to read."""
    try:
        data = json.loads((output_dir / JOB_CONFIG_FILE).read_text(encoding="utf-8"))
        return ModelSpec.model_validate(data["model"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_main_job(config: MainJobConfig, console: Console, live: bool = True, source: str = "<main job>") -> JobState:
    output_dir = config.output_dir.resolve()
    config = config.model_copy(update={"output_dir": output_dir})
    if (output_dir / REGISTRY_FILE).exists():
        raise ConfigError(f"{output_dir}: already holds a main job; choose a new output_dir (or `rlplex resume`)")
    output_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"checking the shared base model {config.model.name} ...")
    check_model(config)
    if config.inference.engine == "vllm":
        ensure_api_key(config.endpoint_dir)  # before any process starts: servers and clients read it
    write_registry(output_dir, list(config.runs))
    # `rlplex resume` reads the job back from here (JSON: the folder crosses a trust boundary).
    write_file_atomic(output_dir / JOB_CONFIG_FILE, config.model_dump_json(indent=2).encode())
    master = PrimeMaster.create(build_job_spec(config, source))
    console.print(f"job {master.job_id}: starting; from another shell: rlplex status {output_dir}")
    return _drive(master, config, console, live, start=True)


def resume_main_job(output_dir: Path, console: Console, live: bool = True) -> JobState:
    """Take over a main job whose `rlplex run` died: the nodes kept running; this reattaches a
    master to them and carries on (requests, live view, report) where the dead one stopped."""
    output_dir = output_dir.resolve()
    path = output_dir / JOB_CONFIG_FILE
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"{path}: no main job to resume here ({error.strerror})") from None
    config = validate_config(MainJobConfig, json.loads(text) | {"output_dir": str(output_dir)}, source=str(path))
    master = PrimeMaster.resume(output_dir)
    console.print(f"job {master.job_id}: resumed in state {master.state.value}")
    return _drive(master, config, console, live, start=False)


def _drive(master: PrimeMaster, config: MainJobConfig, console: Console, live: bool, start: bool) -> JobState:
    output_dir = config.output_dir
    started = time.monotonic()
    state = master.state
    try:
        if start:
            master.start()
        display = Live(render(collect(output_dir)), console=console, auto_refresh=False) if live else None
        with display or contextlib.nullcontext():
            next_view = 0.0
            while (state := master.monitor()) not in TERMINAL_JOB_STATES:
                accept_requests(master, output_dir, config.model, config.inference, config.endpoint_dir)
                now = time.monotonic()
                if now - started > config.timeout_s:
                    master.manager.fail(f"the job ran past its timeout_s of {config.timeout_s:g} s")
                if display is not None and now >= next_view:
                    display.update(render(collect(output_dir)), refresh=True)
                    next_view = now + config.refresh_s
                time.sleep(master.manager.spec.monitor_interval_s)
            if display is not None:
                display.update(render(collect(output_dir)), refresh=True)
        if display is not None and not console.is_terminal:
            console.print()  # a live view drawn to a file or pipe ends without a newline
    finally:
        master.stop("master exiting")
        master.close()
        report = write_report(output_dir, time.monotonic() - started)
        console.print(f"job {state.value}; report: {report}")
    return state
