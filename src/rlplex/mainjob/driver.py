"""`rlplex run`: start the main job under a PrimeMaster, keep the live view up, take add
requests, and write the report when the job ends (whatever way it ends)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live

from rlplex.config import validate_config
from rlplex.control.job.master import PrimeMaster
from rlplex.control.job.states import TERMINAL_JOB_STATES, JobState
from rlplex.control.job.stop_request import clear_stop_request, request_stop, stop_requested, wait_for_stop
from rlplex.dashboard.sources import EVENTS
from rlplex.errors import ConfigError, JobFailedError, JobInterruptedError, RlplexError
from rlplex.inference.config import InferenceConfig
from rlplex.inference.vllm_server import ensure_api_key, require_vllm
from rlplex.io.safe_files import ensure_output_dir, read_regular_text, write_file_atomic
from rlplex.mainjob.build import ROLLOUT_ROLE, build_job_spec
from rlplex.mainjob.conductor import TERMINAL_RUN_STATES
from rlplex.mainjob.config import JOB_CONFIG_FILE, MainJobConfig, RunEntry
from rlplex.mainjob.frame import render
from rlplex.mainjob.lines import ProgressLines
from rlplex.mainjob.preflight import check_main_job, run_problems
from rlplex.mainjob.registry import (
    REGISTRY_FILE,
    answer,
    duplicate_run,
    pending_requests,
    read_registry,
    rollout_slots,
    write_registry,
)
from rlplex.mainjob.report import write_report
from rlplex.mainjob.view import JobView, collect
from rlplex.models.spec import ModelSpec
from rlplex.multirun.rundir import run_folder_problem

if TYPE_CHECKING:
    from rlplex.dashboard.server import DashboardServer


def accept_requests(
    master: PrimeMaster,
    output_dir: Path,
    model: ModelSpec,
    inference: InferenceConfig | None = None,
    endpoint_dir: Path | None = None,
    job: MainJobConfig | None = None,
) -> list[str]:
    """Add the runs asked for since the last call (their model and engine fields filled from the
    job's); each request gets its answer file."""
    added = []
    for request in pending_requests(output_dir):
        if isinstance(request, tuple):
            answer(request[0], False, request[1])
            continue
        registry = read_registry(output_dir)
        entry = request.entry.with_model(model, inference, endpoint_dir, None if job is None else job.run_logging())
        try:
            if entry.id in {e.id for e in registry}:
                raise ConfigError(duplicate_run(entry.id))
            folder = output_dir / "runs" / entry.id
            # The trainer would ignore such a folder, and the view show the linked run's curve under this id.
            if os.path.lexists(folder) and (problem := run_folder_problem(folder)):
                raise ConfigError(f"{folder}: {problem}: run {entry.id!r} cannot use it")
            run_config = entry.orch_config(str(request.path))
        except RlplexError as error:
            answer(request.path, False, str(error))
            continue
        if job is not None and (problems := run_problems(entry, job, str(request.path))):
            answer(request.path, False, "; ".join(problems))  # the trainer would never admit it
            continue
        write_registry(output_dir, [*registry, entry])
        master.scale_role("orchestrator", len(registry) + 1)
        if run_config.rollout_workers > 1:  # it generates on nodes of its own
            master.scale_role(ROLLOUT_ROLE, len(rollout_slots([*registry, entry])))
        answer(request.path, True, f"{entry.id} added as orchestrator rank {len(registry)}")
        added.append(entry.id)
    return added


def check_model(config: MainJobConfig) -> None:
    """Load the job's tokenizer now: a model that cannot be found fails before any process starts."""
    from rlplex.models.hf import check_tokenizer

    if config.model.device == "cuda":  # "auto" and "cpu" resolve on any machine: torch is not needed
        from rlplex.models.device import resolve_device

        resolve_device(config.model.device)
    check_tokenizer(config.model)
    if config.inference.engine == "vllm":
        require_vllm(config.model)


def preflight(config: MainJobConfig, source: str, check_runs: bool = True) -> None:
    """What `rlplex run` checks before any process starts (`rlplex check` stops there): the
    model's tokenizer loads, then, with `check_runs`, every run (`preflight.check_main_job`)."""
    check_model(config)
    if check_runs:
        check_main_job(config, source)


def read_job_model(output_dir: Path) -> ModelSpec | None:
    """The `[model]` of the main job in `output_dir`, or None when there is none to read."""
    try:
        data = json.loads(read_regular_text(output_dir / JOB_CONFIG_FILE))
        return ModelSpec.model_validate(data["model"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def earlier_job_advice(output_dir: Path, source: str) -> str:
    """What to do about the main job already in `output_dir`, by what it is doing: each suggested
    command works in that state (a live job cannot be resumed; a finished one has nothing left)."""
    elsewhere = f"`rlplex run {source} --output NEW_FOLDER` starts a new job beside it"
    view = collect(output_dir)
    if view.job_state not in TERMINAL_JOB_STATES and view.master_alive:
        return (
            f"it is running (master pid {view.master_pid}): watch it with `rlplex status {output_dir}`, "
            f"stop it with `rlplex stop {output_dir}`; {elsewhere}"
        )
    left = [run.run_id for run in view.runs if run.state not in TERMINAL_RUN_STATES]
    if left:
        return f"unfinished runs {', '.join(left)}: continue them with `rlplex resume {output_dir}`; {elsewhere}"
    return f"its runs have ended (report: {output_dir / 'report.md'}); {elsewhere}"


def run_main_job(
    config: MainJobConfig,
    console: Console,
    live: bool = True,
    source: str = "<main job>",
    check_runs: bool = True,
) -> JobState:
    """Start the main job and see it to its end. `check_runs`: check every run against the
    trainer first (`preflight`); off, the trainer judges each run when it discovers it."""
    output_dir = config.output_dir.resolve()
    config = config.model_copy(update={"output_dir": output_dir})
    if os.path.lexists(output_dir / REGISTRY_FILE):
        raise ConfigError(f"{output_dir}: already holds a main job: {earlier_job_advice(output_dir, source)}")
    console.print(f"checking the shared base model {config.model.name} and the runs ...")
    preflight(config, source, check_runs)
    ensure_output_dir(output_dir, f"{source}: field 'output_dir'")
    if config.inference.engine == "vllm":
        ensure_api_key(config.endpoint_dir)  # before any process starts: servers and clients read it
    write_registry(output_dir, list(config.runs))
    # `rlplex resume` reads the job back from here (JSON: the folder crosses a trust boundary).
    write_file_atomic(output_dir / JOB_CONFIG_FILE, config.model_dump_json(indent=2).encode())
    master = PrimeMaster.create(build_job_spec(config, source))
    console.print(f"job {master.job_id}: starting; from another shell: rlplex status {output_dir}")
    return _drive(master, config, console, live, start=True)


def read_saved_config(output_dir: Path) -> MainJobConfig:
    """The main job saved in `output_dir` at its creation (`main_job.json`)."""
    path = output_dir / JOB_CONFIG_FILE
    try:
        data = json.loads(read_regular_text(path))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no main job here (no such file)") from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: unreadable main job record ({error})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return validate_config(MainJobConfig, data | {"output_dir": str(output_dir)}, source=str(path))


def resume_main_job(output_dir: Path, console: Console, live: bool = True) -> JobState:
    """Carry on the main job in `output_dir`, whichever way its `rlplex run` ended.

    - Its master died (SIGKILL, a crash) and the job is still RUNNING: the nodes kept running;
      a new master reattaches to them and carries on (requests, live view, report).
    - It was stopped (Ctrl-C, SIGTERM, SIGHUP, `rlplex stop`) or failed: a new control-plane job
      starts in the same folder. Every run resumes from its checkpoints: the trainer from its
      newest stable checkpoint, each orchestrator at its first step without stable rollouts;
      finished, evicted and rejected runs stay as they are (their nodes end at once).
    """
    output_dir = output_dir.resolve()
    config = read_saved_config(output_dir)
    view = collect(output_dir)
    if view.job_state not in {s.value for s in TERMINAL_JOB_STATES}:
        if view.master_alive:
            raise ConfigError(
                f"{output_dir / 'job.sqlite'}: job {view.job_state} and its master (pid {view.master_pid}) is "
                f"still running; stop it first with `rlplex stop {output_dir}`"
            )
        master = PrimeMaster.resume(output_dir)
        console.print(f"job {master.job_id}: resumed; from another shell: rlplex status {output_dir}")
        return _drive(master, config, console, live, start=False)
    unfinished = [run.run_id for run in view.runs if run.state not in TERMINAL_RUN_STATES]
    if not unfinished:
        # Not an error: a stop can land as the last step is trained, and continuing is then done.
        console.print(f"{output_dir}: every run of this job is already done ({view.outcome}); nothing to continue")
        return JobState(view.job_state)
    config = continued_config(config, read_registry(output_dir), view)
    clear_stop_request(output_dir)
    console.print(f"continuing the job in {output_dir} ({view.outcome}): runs {', '.join(unfinished)}")
    master = PrimeMaster.create(build_job_spec(config, str(output_dir / JOB_CONFIG_FILE)))
    return _drive(master, config, console, live, start=True)


def continued_config(config: MainJobConfig, registry: list[RunEntry], view: JobView) -> MainJobConfig:
    """The file's config as a new job continues it: every run the job took (its registry, in
    order: orchestrator rank r serves entry r) is a run of its own, and the events that already
    did their work are gone: a run that was added is not added again, a run that ended is not
    evicted."""
    added = {entry.id for entry in registry}
    ended = {run.run_id for run in view.runs if run.state in TERMINAL_RUN_STATES}
    return config.model_copy(
        update={
            "runs": registry,
            "later_runs": [e for e in config.later_runs if e.id not in added],
            "events": [e for e in config.events if e.add_run not in added and e.evict_run not in ended],
        }
    )


def stop_main_job(output_dir: Path, console: Console, timeout_s: float = 180.0) -> str:
    """What `rlplex stop` does: ask the job's master to stop the job gracefully and wait until
    it has (report written). A job whose master died is taken over by this process and stopped."""
    read_saved_config(output_dir)  # a one-line error unless a main job is here
    view = collect(output_dir)
    if view.job_state in {s.value for s in TERMINAL_JOB_STATES} or view.job_state == "UNKNOWN":
        return f"job {view.outcome}: nothing to stop"
    if not view.master_alive:
        master = PrimeMaster.resume(output_dir)
        try:
            master.stop("stopped by `rlplex stop` (its master was gone)")
        finally:
            master.close()
        report = write_report(output_dir, 0.0)
        return f"job {collect(output_dir).outcome}; report: {report}"
    request = request_stop(output_dir, "stopped by `rlplex stop`")
    wait_for_stop(request, timeout_s, lambda: collect(output_dir).master_alive)
    return f"job {collect(output_dir).outcome}; report: {output_dir / 'report.md'}"


class _StopSignals:
    """SIGINT, SIGTERM and SIGHUP ask the master's loop to stop the job gracefully (checkpoints,
    report) instead of killing `rlplex run` between two steps of the control loop; a second
    SIGINT interrupts at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = self.received or signum

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():  # signal.signal works there only
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _drive(master: PrimeMaster, config: MainJobConfig, console: Console, live: bool, start: bool) -> JobState:
    output_dir = config.output_dir
    started = time.monotonic()
    state = master.state
    stopped_by: str | None = None
    dashboard: DashboardServer | None = None
    with _StopSignals() as signals:
        try:
            if start and signals.received is None:
                master.start()
            # A live view redraws in place: to a file or pipe (nohup, Slurm, CI) it prints lines instead.
            live = live and console.is_terminal
            display = (
                Live(render(collect(output_dir), live=True), console=console, auto_refresh=False) if live else None
            )
            lines = None if live else ProgressLines(config.logging.print_every_s)
            dashboard = _start_dashboard(config, console)
            # The dashboard is handed the view this loop reads anyway: the folder is read once.
            events = EVENTS if dashboard is not None else 0
            publish = dashboard.source.publish if dashboard is not None else (lambda view: None)
            with display or contextlib.nullcontext():
                next_view = 0.0
                while (state := master.monitor()) not in TERMINAL_JOB_STATES:
                    if signals.received is not None or (stopped_by := stop_requested(output_dir)) is not None:
                        break
                    accept_requests(master, output_dir, config.model, config.inference, config.endpoint_dir, config)
                    now = time.monotonic()
                    if now - started > config.timeout_s:
                        master.manager.fail(f"the job ran past its timeout_s of {config.timeout_s:g} s")
                    if now >= next_view:
                        publish(view := collect(output_dir, events=events))
                        _show(view, display, lines, console, now)
                        next_view = now + config.refresh_s
                    time.sleep(master.manager.spec.monitor_interval_s)
                publish(view := collect(output_dir, events=events))
                _show(view, display, lines, console, time.monotonic())
        finally:
            if signals.received is not None:
                stopped_by = f"stopped by {signal.Signals(signals.received).name}"
            master.stop(stopped_by or "master exiting")
            state = master.state
            master.close()
            report = write_report(output_dir, time.monotonic() - started)
            clear_stop_request(output_dir)  # last: `rlplex stop` waits for it to go
            view = collect(output_dir)
            left = [run.run_id for run in view.runs if run.state not in TERMINAL_RUN_STATES]
            last = f"job {view.outcome}; report: {report}"
            if stopped_by is not None and left:
                last += f"; unfinished runs: {', '.join(left)}: continue with `rlplex resume {output_dir}`"
            if signals.received is None:
                console.print(last, highlight=False, soft_wrap=True)
            if dashboard is not None:  # the page's last view: the job as it ended
                dashboard.source.publish(collect(output_dir, events=EVENTS))
                dashboard.close()
    if signals.received is not None:  # the command's last line, said once (by `guard`), with its exit code
        raise JobInterruptedError(last, signals.received)
    if stopped_by is None:
        _fail_unless_a_run_finished(output_dir, report)
    return state


def _start_dashboard(config: MainJobConfig, console: Console) -> DashboardServer | None:
    """`[dashboard] enabled = true`: the page served from a thread of this process; its link
    printed once."""
    if not config.dashboard.enabled:
        return None
    from rlplex.dashboard.server import DashboardServer
    from rlplex.dashboard.sources import ViewSource

    source = ViewSource(config.output_dir, reads_folder=False)
    server = DashboardServer.create(config.output_dir, config.dashboard, source)
    server.start()
    mode = "actions allowed" if config.dashboard.allow_actions else "read-only"
    console.print(f"dashboard ({mode}): {server.url}", highlight=False, soft_wrap=True)
    return server


def _show(view: JobView, display: Live | None, lines: ProgressLines | None, console: Console, now: float) -> None:
    if display is not None:
        display.update(render(view, live=True), refresh=True)
    for line in lines.lines(view, now) if lines is not None else ():
        console.print(line, highlight=False, soft_wrap=True, markup=False)


def _fail_unless_a_run_finished(output_dir: Path, report: Path) -> None:
    """A job that ended with every run rejected (none finished) trained nothing: a failure, whose
    line names each run and why, not a quiet STOPPED."""
    runs = collect(output_dir).runs
    rejected = [run for run in runs if run.state == "rejected"]
    if rejected and not any(run.state == "finished" for run in runs):
        reasons = "; ".join(f"{run.run_id} was rejected: {run.reason or 'no reason given'}" for run in rejected)
        raise JobFailedError(f"no run finished: {reasons}; report: {report}")
