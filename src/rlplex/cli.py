"""The `rlplex` command line. It wires layers together and holds no training logic.

User errors (`RlplexError`) print one clear line and exit with code 2; `--debug` shows the
traceback instead. Exit code 1 is a failed run (`RunFailedError`: a process died, a wait timed
out, an error inside a rank) or an unexpected failure; 128 + N a stop by signal N.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from rlplex.cli_mainjob import RAY_ADDRESS_HELP, check_file_kind, guard
from rlplex.processes import stop_signals_as_interrupt

if TYPE_CHECKING:
    from rlplex.runners.config import TrainConfig
    from rlplex.runners.minibatch import TrainResult

app = typer.Typer(
    rich_markup_mode=None,
    help="rlplex: reinforcement-learning training jobs.",
    no_args_is_help=True,
    add_completion=False,
    # Every command's subcommands inherit it: `-h` wherever `--help` works.
    context_settings={"help_option_names": ["-h", "--help"]},
)
console = Console()


def _print_version(asked: bool) -> None:
    if asked:
        from rlplex import __version__

        console.print(f"rlplex {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", help="print rlplex's version and exit", callback=_print_version, is_eager=True)
    ] = False,
) -> None:
    """rlplex: reinforcement-learning training jobs, from CartPole to many LLM runs on one trainer."""
    # A run's reward (`module:function`) is the user's own module, found from the directory they
    # run rlplex in, as `python -m` finds it; a console script's path lacks that directory. It is
    # appended, so a folder named like an installed package cannot shadow it. The job's nodes and
    # reward children inherit this path.
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())


def _override(config: Any, **runner_fields: Any) -> Any:
    """`config` with the `[runner]` fields given on the command line (None: not given)."""
    runner_updates = {name: value for name, value in runner_fields.items() if value is not None}
    if not runner_updates:
        return config
    from rlplex.config import validate_config

    data = config.model_dump()
    data["runner"].update(runner_updates)
    return validate_config(type(config), data, source="command-line flags")


@app.command(short_help="Train a classic RL agent (PPO, DQN, SAC and others) from a TOML file.")
def train(
    config_file: Annotated[Path, typer.Argument(help="TOML file with [env], [sampler], [agent], [algo], [runner]")],
    output: Annotated[Path | None, typer.Option(help="output folder (default outputs/<file stem>)")] = None,
    resume: Annotated[bool, typer.Option(help="continue from the latest snapshot in the output folder")] = False,
    overwrite: Annotated[
        bool, typer.Option(help="start afresh in an output folder that holds an earlier run (its files are replaced)")
    ] = False,
    seed: Annotated[int | None, typer.Option(help="override runner.seed")] = None,
    n_steps: Annotated[int | None, typer.Option(help="override runner.n_steps")] = None,
    schedule_steps: Annotated[
        int | None,
        typer.Option(help="override runner.schedule_steps (a resume keeps the snapshot's schedule horizon otherwise)"),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(metavar="auto|cpu|cuda", help="override runner.device: auto (CUDA when present), cpu or cuda"),
    ] = None,
    progress: Annotated[bool, typer.Option(help="show a live progress line")] = True,
    supervise: Annotated[
        bool,
        typer.Option(
            help="run as a local control-plane job (<output>/train_job) that restarts the run from its newest "
            "snapshot when it crashes or is killed"
        ),
    ] = False,
    max_restarts: Annotated[
        int, typer.Option(min=0, metavar="N", help="with --supervise: restarts before the run fails")
    ] = 3,
    debug: Annotated[bool, typer.Option(help="show tracebacks for user errors")] = False,
) -> None:
    """Train a classic RL agent with the runners (MinibatchRl, SyncRl, AsyncRl, ...)."""
    with stop_signals_as_interrupt() as received:
        try:
            guard(
                console,
                debug,
                lambda: _train(
                    config_file,
                    output,
                    resume,
                    overwrite,
                    progress,
                    max_restarts if supervise else None,
                    seed=seed,
                    n_steps=n_steps,
                    schedule_steps=schedule_steps,
                    device=device,
                ),
                "run failed",
            )
        except KeyboardInterrupt:
            signum = received[-1] if received else signal.SIGINT
            console.print(_stopped_advice(signum, _train_output(config_file, output)), highlight=False)
            raise typer.Exit(128 + signum) from None


def _train_output(config_file: Path, output: Path | None) -> Path:
    return output or Path("outputs") / config_file.stem


def _stopped_advice(signum: int, output: Path) -> str:
    """A stopped `rlplex train`'s last line: --resume where a snapshot was written, else --overwrite
    (--resume would find nothing to continue from)."""
    from rlplex.io.snapshot import list_snapshots

    stopped = f"stopped by {signal.Signals(signum).name}"
    if list_snapshots(output / "snapshots"):
        return f"{stopped}; continue with --resume"
    return f"{stopped} before its first snapshot; start again with --overwrite"


# What a finished or interrupted `rlplex train` leaves in its output folder.
TRAIN_OUTPUTS = ("progress.csv", "snapshots", "config.json", "learning_curve.png", "tb", "wandb")


def _train(
    config_file: Path,
    output: Path | None,
    resume: bool,
    overwrite: bool,
    progress: bool,
    supervised_restarts: int | None,
    **runner_fields: Any,
) -> None:
    import shutil

    import psutil

    from rlplex.envs import probe_spaces
    from rlplex.errors import ConfigError
    from rlplex.io.safe_files import ensure_output_dir
    from rlplex.io.snapshot import list_snapshots
    from rlplex.models.device import resolve_device
    from rlplex.runners.config import build_runner, check_fits_in_memory, cpu_advice, load_train_config

    if resume and overwrite:
        raise ConfigError("--resume and --overwrite: choose one")
    check_file_kind(config_file, "train")
    config = _override(load_train_config(config_file), **runner_fields)
    spaces = probe_spaces(config.env)
    check_fits_in_memory(config, spaces, psutil.virtual_memory().total, str(config_file))
    output = _train_output(config_file, output)
    earlier = [name for name in TRAIN_OUTPUTS if os.path.lexists(output / name)] if output.is_dir() else []
    if earlier and not resume and not overwrite:
        raise ConfigError(
            f"{output}: holds an earlier run ({', '.join(earlier)}); continue it with --resume, "
            "replace it with --overwrite, or choose another --output"
        )
    # Everything that can refuse the run is checked before the folder gets a file: a refused
    # --device must not leave a config.json that the corrected command then calls an earlier run.
    device = resolve_device(config.runner.device, "runner.device")
    snapshots = list_snapshots(output / "snapshots") if resume else []
    if resume and not snapshots:
        raise ConfigError(
            f"{output / 'snapshots'}: no snapshot to resume from (the run stopped before its first); "
            "start again with --overwrite"
        )
    ensure_output_dir(output, "--output")
    if overwrite:
        for name in earlier:
            target = output / name
            shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
    (output / "config.json").write_text(config.model_dump_json(indent=2))
    snapshot = snapshots[-1][1] if snapshots else None  # the newest
    console.print(
        f"training {config.env.id} with {config.algo.name} ({config.runner.kind}) on {device.type}; output in {output}"
    )
    advice = cpu_advice(config, spaces, device)
    if advice is not None:
        console.print(advice, highlight=False)
    if supervised_restarts is not None:
        from rlplex.runners.train_node import run_train_job

        code = run_train_job(config, output, supervised_restarts)
        if code >= 128:
            console.print(_stopped_advice(code - 128, output), highlight=False)
        if code:
            raise typer.Exit(code)
        _train_summary(config, output, None)
        return
    runner = build_runner(config, output, show_progress=progress)
    if snapshot is not None:
        runner.resume_from(snapshot)
        console.print(f"resuming from {snapshot}")
    _train_summary(config, output, runner.train())


def _train_summary(config: TrainConfig, output: Path, result: TrainResult | None) -> None:
    """The learning curve to PNG and the summary table; `result` None: read from progress.csv alone."""
    from rlplex.diagnostics.metrics import read_metrics_csv
    from rlplex.diagnostics.plots import plot_learning_curves

    rows = read_metrics_csv(output / "progress.csv") if (output / "progress.csv").exists() else []
    curves = {}
    for key, label in (("charts/eval_return_mean", "evaluation"), ("charts/online_return_mean", "training episodes")):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            curves[label] = ([p[0] for p in points], [p[1] for p in points])
    png = plot_learning_curves(curves, output / "learning_curve.png", title=f"{config.env.id}: {config.algo.name}")

    table = Table(title="rlplex train: summary")
    table.add_column("figure")
    table.add_column("value", justify="right")
    if result is not None:
        last = result.history[-1] if result.history else {}
        env_steps, wall_time_s = result.env_steps, result.wall_time_s
    else:  # a supervised run: its rows, written across its restarts
        last = rows[-1] if rows else {}
        env_steps, wall_time_s = int(last.get("step", 0)), last.get("charts/wall_time_s", 0.0)
    table.add_row("env steps", f"{env_steps:,}")
    table.add_row("wall time", f"{wall_time_s:.1f} s")
    for key in ("charts/eval_return_mean", "charts/online_return_mean", "charts/env_steps_per_s"):
        if key in last:
            table.add_row(key, f"{last[key]:.1f}")
    if result is not None and result.target_reached_at_steps is not None:
        table.add_row(
            "target reached at", f"{result.target_reached_at_steps:,} steps, {result.target_reached_at_s:.1f} s"
        )
    table.add_row("learning curve", str(png))
    table.add_row("metrics", f"{output / 'progress.csv'}, TensorBoard: {output / 'tb'}")
    console.print(table)


job_app = typer.Typer(
    rich_markup_mode=None, help="Control-plane jobs: run, watch, stop and resume a job of roles.", no_args_is_help=True
)
app.add_typer(job_app, name="job")


def _run_job_command(body: Any, debug: bool) -> None:
    with stop_signals_as_interrupt() as received:
        try:
            guard(console, debug, body, "job failed")
        except KeyboardInterrupt:  # the master has stopped the job on its way out (`drive`)
            raise typer.Exit(128 + (received[-1] if received else signal.SIGINT)) from None


def _drive_on_ray(job_file: Path, backend: str | None, ray_address: str | None) -> None:
    """The master as a restartable Ray actor; this command only watches it."""
    from rlplex.control.backends.ray_master import RayMasterHandle
    from rlplex.control.job.master import backend_overrides
    from rlplex.control.job.spec import load_job, parse_job

    spec = load_job(job_file)
    spec = parse_job(spec.model_dump(mode="json") | backend_overrides(backend, ray_address), str(job_file))
    _watch_on_ray(RayMasterHandle.launch(spec), "started")


def _watch_on_ray(handle: Any, what: str) -> None:
    """Wait for the job of a master actor to end, then give the actor back."""
    from rlplex.control.job.states import job_outcome
    from rlplex.mainjob.view import read_job

    spec = handle.spec
    try:
        console.print(f"job {spec.name}: master actor {what} on Ray; status: rlplex job status {spec.output_dir}")
        handle.wait()
    finally:
        handle.close()  # a job still running (Ctrl-C here) is stopped first
        found = read_job(spec.output_dir)
        if found is not None:
            console.print(f"job {found[0].job_id}: {job_outcome(found[0].state, found[0].cause)}", highlight=False)


@job_app.command("run", short_help="Run a job of roles until its drivers or workers finish.")
def job_run(
    job_file: Annotated[Path, typer.Argument(help="TOML job file: name, output_dir, [roles.<name>] ...")],
    backend: Annotated[
        str | None,
        typer.Option(metavar="local|ray", help="local or ray (default: $RLPLEX_BACKEND, else the job file's)"),
    ] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(metavar="ADDRESS", help=RAY_ADDRESS_HELP + " (default: $RLPLEX_RAY_ADDRESS, else a local Ray)"),
    ] = None,
    debug: Annotated[bool, typer.Option(help="show tracebacks for user errors")] = False,
) -> None:
    """Run a job until its drivers (or, without drivers, all its workers) finish."""
    from rlplex.control.job.master import PrimeMaster, backend_overrides, drive
    from rlplex.control.job.spec import load_job

    def body() -> None:
        check_file_kind(job_file, "job")
        chosen = backend_overrides(backend, ray_address).get("backend") or load_job(job_file).backend
        if chosen == "ray":
            _drive_on_ray(job_file, backend, ray_address)
        else:
            drive(PrimeMaster.create(job_file, backend=backend, ray_address=ray_address), console.print)

    _run_job_command(body, debug)


@job_app.command("resume", short_help="Take over a job whose master died: reattach, carry on.")
def job_resume(
    output_dir: Annotated[Path, typer.Argument(help="the job's output folder (holds job.sqlite)")],
    ray_address: Annotated[
        str | None,
        typer.Option(
            metavar="ADDRESS",
            help="a Ray job's cluster (default: $RLPLEX_RAY_ADDRESS, else the job's, else a local Ray)",
        ),
    ] = None,
    debug: Annotated[bool, typer.Option(help="show tracebacks for user errors")] = False,
) -> None:
    """Master failover: re-attach to the job's live nodes, restart lost ones, and go on.

    A Ray job's new master is a restartable Ray actor, as under `rlplex job run`."""
    from rlplex.control.job.master import PrimeMaster, backend_overrides, drive, resumable_spec

    def body() -> None:
        if resumable_spec(output_dir).backend == "ray":
            from rlplex.control.backends.ray_master import RayMasterHandle

            address = backend_overrides(None, ray_address).get("ray_address")
            _watch_on_ray(RayMasterHandle.resume(output_dir, address), "resumed")
        else:
            drive(PrimeMaster.resume(output_dir), console.print)

    _run_job_command(body, debug)


@job_app.command("stop", short_help="Stop a job: its nodes stop, the master ends it.")
def job_stop(
    output_dir: Annotated[Path, typer.Argument(help="the job's output folder (holds job.sqlite)")],
    timeout_s: Annotated[float, typer.Option(help="wait this long for the job to stop")] = 60.0,
    debug: Annotated[bool, typer.Option(help="show tracebacks for user errors")] = False,
) -> None:
    """Ask the job's master to stop the job and wait until it has; a local job whose master died
    is taken over and stopped. For a main job, `rlplex stop` also checkpoints and reports."""
    from rlplex.control.job.master import stop_job

    _run_job_command(lambda: console.print(stop_job(output_dir, timeout_s), highlight=False), debug)


@job_app.command("status", short_help="The job's state and every node's role, rank and state.")
def job_status(
    output_dir: Annotated[Path, typer.Argument(help="the job's output folder (holds job.sqlite)")],
    debug: Annotated[bool, typer.Option(help="show tracebacks for user errors")] = False,
) -> None:
    """Show the job's state and every node's role, rank, state, restarts, last heartbeat and progress."""
    _run_job_command(lambda: _print_status(output_dir), debug)


def _print_status(output_dir: Path) -> None:
    import time

    from rlplex.errors import ConfigError
    from rlplex.mainjob.view import read_job

    found = read_job(output_dir)  # a corrupt or odd job.sqlite is a one-line error
    if found is None:
        raise ConfigError(f"{output_dir}: no job recorded")
    job, nodes = found
    from rlplex.control.job.states import job_outcome

    cause = f"; cause: {job.cause}" if job.cause else ""
    console.print(
        f"job {job.job_id} ({job.name}): [bold]{job_outcome(job.state, job.cause)}[/], restarts {job.restarts}{cause}",
        highlight=False,
    )
    table = Table()
    for column in ("role", "rank", "state", "restarts", "pid", "heartbeat age", "progress", "last cause"):
        table.add_column(column)
    now = time.time()
    for node in nodes:
        age = f"{now - node.last_heartbeat:.1f} s" if node.last_heartbeat else "-"
        progress = ", ".join(f"{k}={v:g}" for k, v in node.progress.items()) or "-"
        table.add_row(
            node.role, str(node.rank), node.state, str(node.restarts), str(node.pid), age, progress, node.cause
        )
    console.print(table)
    from rlplex.control.elastic.master import rendezvous_summaries

    for line in rendezvous_summaries(output_dir):
        console.print(line, highlight=False)


def _register_main_job() -> None:
    from rlplex.cli_mainjob import register
    from rlplex.cli_model import register as register_model

    register(app, console)
    register_model(app, console)


_register_main_job()


def main() -> None:
    # `kill -USR1 <pid>` prints every thread's stack to stderr (the log) and carries on: what a
    # user, or a test, needs of a command that seems stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
