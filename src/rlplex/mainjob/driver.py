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
from rlplex.mainjob.build import build_job_spec
from rlplex.mainjob.config import MainJobConfig
from rlplex.mainjob.registry import REGISTRY_FILE, answer, pending_requests, read_registry, write_registry
from rlplex.mainjob.report import write_report
from rlplex.mainjob.view import collect, render
from rlplex.multirun.rundir import write_file_atomic


def accept_requests(master: PrimeMaster, output_dir: Path) -> list[str]:
    """Add the runs asked for since the last call; each request gets its answer file."""
    added = []
    for request in pending_requests(output_dir):
        if isinstance(request, tuple):
            answer(request[0], False, request[1])
            continue
        registry = read_registry(output_dir)
        try:
            if request.entry.id in {entry.id for entry in registry}:
                raise ConfigError(f"{request.path}: run {request.entry.id!r} is already in the job")
            request.entry.orch_config(str(request.path))
        except RlplexError as error:
            answer(request.path, False, str(error))
            continue
        write_registry(output_dir, [*registry, request.entry])
        master.scale_role("orchestrator", len(registry) + 1)
        answer(request.path, True, f"{request.entry.id} added as orchestrator rank {len(registry)}")
        added.append(request.entry.id)
    return added


def prepare_base_model(config: MainJobConfig) -> Path:
    """Warm up the shared base model once, before any node needs it, and return the orch.toml
    the trainer takes its base from (the first run's: every run must declare the same base)."""
    from rlplex.multirun.base_model import base_model
    from rlplex.multirun.orch_config import orch_config_to_toml

    first = config.runs[0].orch_config(source=str(config.output_dir))
    config.runs_dir.mkdir(parents=True, exist_ok=True)
    base_model(first, config.runs_dir)
    reference = config.output_dir / "base_model.toml"
    write_file_atomic(reference, orch_config_to_toml(first).encode())
    return reference


JOB_CONFIG_FILE = "main_job.json"


def run_main_job(config: MainJobConfig, console: Console, live: bool = True, source: str = "<main job>") -> JobState:
    output_dir = config.output_dir.resolve()
    config = config.model_copy(update={"output_dir": output_dir})
    if (output_dir / REGISTRY_FILE).exists():
        raise ConfigError(f"{output_dir}: already holds a main job; choose a new output_dir (or `rlplex resume`)")
    output_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"preparing the shared base model in {config.runs_dir} ...")
    base = prepare_base_model(config)
    write_registry(output_dir, list(config.runs))
    # `rlplex resume` reads the job back from here (JSON: the folder crosses a trust boundary).
    write_file_atomic(output_dir / JOB_CONFIG_FILE, config.model_dump_json(indent=2).encode())
    master = PrimeMaster.create(build_job_spec(config, base, source))
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
                accept_requests(master, output_dir)
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
