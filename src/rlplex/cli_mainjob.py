"""The main job's commands: `rlplex run`, `rlplex resume`, `rlplex status`, `rlplex runs add|evict`.

Exit codes: 0 done, 1 the job failed, 2 a user error (one line; `--debug` for the traceback).
Precedence: the job file < environment (RLPLEX_BACKEND, RLPLEX_RAY_ADDRESS) < flags.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from rlplex.errors import RlplexError

EXIT_JOB_FAILED, EXIT_USER_ERROR = 1, 2
DEBUG_HELP = "show tracebacks for user errors"
RAY_ADDRESS_HELP = "an existing Ray cluster, e.g. auto or ray://10.0.0.5:10001"


def print_error(console: Console, label: str, message: object) -> None:
    """One line, whatever the terminal width (one per problem when the error lists several);
    the message is escaped because error texts quote TOML sections like [roles.w], which rich
    would otherwise take for markup and drop."""
    lines = getattr(message, "problems", None) or [str(message)]
    for line in lines:
        console.print(f"[bold red]{label}:[/] {escape(str(line))}", highlight=False, soft_wrap=True)


def check_file_kind(path: Path, expected: str) -> None:
    """A file of another kind fails in one line naming its kind and command (`check_config_kind`)."""
    from rlplex.config import check_config_kind, read_toml

    check_config_kind(read_toml(path), str(path), expected)


def guard(console: Console, debug: bool, body: Callable[[], int | None], failed: str = "failed") -> None:
    """Run a command's body; its errors become one line and the exit code every command shares:
    1 when the run or job failed, 2 for a user error, 128 + N when signal N stopped it."""
    from rlplex.errors import JobInterruptedError, RunFailedError

    try:
        code = body()
    except (JobInterruptedError, RunFailedError, RlplexError) as error:
        if debug:
            raise
        if isinstance(error, JobInterruptedError):
            console.print(str(error), highlight=False, soft_wrap=True)  # "job STOPPED by SIGINT; ..."
            raise typer.Exit(128 + error.signum) from None
        failed_run = isinstance(error, RunFailedError)
        print_error(console, failed if failed_run else "error", error)
        raise typer.Exit(EXIT_JOB_FAILED if failed_run else EXIT_USER_ERROR) from None
    if code:
        raise typer.Exit(code)


def register(app: typer.Typer, console: Console) -> None:
    runs_app = typer.Typer(
        rich_markup_mode=None, help="Add runs to, or evict runs from, a running main job.", no_args_is_help=True
    )
    app.add_typer(runs_app, name="runs")

    @app.command("run", short_help="Run many LLM RL runs on one trainer (a main job).")
    def run(
        job_file: Annotated[
            Path,
            typer.Argument(help="main job TOML: [trainer], [[runs]], [[events]] (--continue: or its folder)"),
        ],
        backend: Annotated[
            str | None, typer.Option(metavar="local|ray", help="local or ray (default: the file's)")
        ] = None,
        ray_address: Annotated[
            str | None, typer.Option(metavar="ADDRESS", help=RAY_ADDRESS_HELP + " (default: a local Ray)")
        ] = None,
        output: Annotated[
            Path | None, typer.Option(metavar="FOLDER", help="the job's folder (default: the file's output_dir)")
        ] = None,
        live: Annotated[bool, typer.Option(help="show the live view")] = True,
        continue_: Annotated[
            bool,
            typer.Option(
                "--continue", help="continue the job in the file's output folder (stopped, failed or masterless)"
            ),
        ] = False,
        debug: Annotated[bool, typer.Option(help=DEBUG_HELP)] = False,
    ) -> None:
        """Run many RL runs on one trainer under the PrimeMaster; writes report.md at the end.

        Ctrl-C, SIGTERM and SIGHUP (and `rlplex stop OUT`) stop the job gracefully: the trainer
        checkpoints, the report is written; `--continue` (or `rlplex resume OUT`) goes on."""

        def body() -> int:
            from rlplex.control.job.states import JobState
            from rlplex.mainjob.config import load_main_job
            from rlplex.mainjob.driver import resume_main_job, run_main_job

            if continue_:
                folder = output or (job_file if job_file.is_dir() else load_main_job(job_file).output_dir)
                state = resume_main_job(folder, console, live=live)
                return 0 if state == JobState.STOPPED else EXIT_JOB_FAILED
            check_file_kind(job_file, "main")
            given = {
                "backend": backend or os.environ.get("RLPLEX_BACKEND"),
                "ray_address": ray_address or os.environ.get("RLPLEX_RAY_ADDRESS"),
                "output_dir": None if output is None else str(output),
            }
            config = load_main_job(job_file, {key: value for key, value in given.items() if value})
            state = run_main_job(config, console, live=live, source=str(job_file))
            return 0 if state == JobState.STOPPED else EXIT_JOB_FAILED

        guard(console, debug, body)

    @app.command("check", short_help="Check a main job file as `rlplex run` would; start nothing.")
    def check(
        job_file: Annotated[Path, typer.Argument(help="main job TOML: [trainer], [[runs]], [[events]]")],
        debug: Annotated[bool, typer.Option(help=DEBUG_HELP)] = False,
    ) -> None:
        """Every check `rlplex run` makes before it starts anything: the file, the model (its
        tokenizer loads), each run's environment (its data is read, its reward called on one row)
        and what the trainer would reject. Exit 0 when all pass, else 2 with one line per problem."""

        def body() -> int:
            from rlplex.mainjob.config import load_main_job
            from rlplex.mainjob.driver import preflight

            check_file_kind(job_file, "main")
            config = load_main_job(job_file)
            preflight(config, str(job_file))
            runs = f"{len(config.runs)} run(s)" + (f" and {len(config.later_runs)} later" if config.later_runs else "")
            console.print(
                f"{job_file}: ok: {runs} on {config.model.name}; nothing was started", highlight=False, soft_wrap=True
            )
            return 0

        guard(console, debug, body)

    @app.command("resume", short_help="Continue a stopped, failed or orphaned main job.")
    def resume(
        output_dir: Annotated[Path, typer.Argument(help="the output folder of a main job")],
        live: Annotated[bool, typer.Option(help="show the live view")] = True,
        debug: Annotated[bool, typer.Option(help=DEBUG_HELP)] = False,
    ) -> None:
        """Continue a main job and see it to the end: reattach to its nodes if its master died;
        if it was stopped or failed, start it again from its checkpoints (unfinished runs only)."""

        def body() -> int:
            from rlplex.control.job.states import JobState
            from rlplex.mainjob.driver import resume_main_job

            state = resume_main_job(output_dir, console, live=live)
            return 0 if state == JobState.STOPPED else EXIT_JOB_FAILED

        guard(console, debug, body)

    @app.command("stop", short_help="Stop a main job gracefully (checkpoints, report).")
    def stop(
        output_dir: Annotated[Path, typer.Argument(help="the main job's output folder")],
        timeout_s: Annotated[float, typer.Option(help="wait this long for the job to stop")] = 180.0,
        debug: Annotated[bool, typer.Option(help=DEBUG_HELP)] = False,
    ) -> None:
        """Stop a main job gracefully: the trainer checkpoints, the report is written; continue
        it later with `rlplex resume OUT`. A job whose master died is taken over and stopped."""

        def body() -> int:
            from rlplex.mainjob.driver import stop_main_job

            console.print(stop_main_job(output_dir.resolve(), console, timeout_s), highlight=False, soft_wrap=True)
            return 0

        guard(console, debug, body)

    @app.command("status", short_help="Each run's state, step, reward and ETA; each node's state.")
    def status(
        output_dir: Annotated[Path, typer.Argument(help="the main job's output folder")],
        debug: Annotated[bool, typer.Option(help=DEBUG_HELP)] = False,
    ) -> None:
        """Per run: state, step, reward, tokens/s, elapsed, ETA; per node: state, restarts, heartbeat age."""

        def body() -> int:
            from rlplex.errors import ConfigError
            from rlplex.mainjob.frame import render
            from rlplex.mainjob.view import collect

            if not output_dir.is_dir():
                raise ConfigError(f"{output_dir}: no such job folder")
            console.print(render(collect(output_dir)))
            return 0

        guard(console, debug, body)

    @runs_app.command("add", short_help="Add a run to a running main job.")
    def runs_add(
        output_dir: Annotated[Path, typer.Argument(help="the running main job's output folder")],
        config: Annotated[Path, typer.Option(help="the run's orch.toml")],
        run_id: Annotated[
            str | None, typer.Option("--id", metavar="RUN_ID", help="run id (default: run_<file stem>)")
        ] = None,
        timeout_s: Annotated[float, typer.Option(help="wait this long for the master's answer")] = 30.0,
        wait_s: Annotated[
            float, typer.Option(help="then wait this long for the trainer to admit or reject the run (0: do not)")
        ] = 60.0,
        debug: Annotated[bool, typer.Option(help=DEBUG_HELP)] = False,
    ) -> None:
        """Add a run to a running job; prints what the trainer decided: admitted, or rejected
        and why (exit 2); or, past --wait-s, that validation is pending and where to look."""

        def body() -> int:
            from rlplex.config import read_toml
            from rlplex.mainjob.actions import add_run
            from rlplex.mainjob.admission import wait_for_trainer

            run = run_id or f"run_{config.stem}"
            accepted, text = add_run(output_dir, run, read_toml(config), str(config), "--id", timeout_s)
            if not accepted:
                print_error(console, "rejected", text)
                return EXIT_USER_ERROR
            console.print(f"accepted by the job: {escape(text)}", highlight=False, soft_wrap=True)
            if wait_s <= 0:
                return 0
            console.print(
                f"waiting up to {wait_s:g} s for the trainer to admit or reject {run} (--wait-s) ...",
                highlight=False,
            )
            with console.status(f"{run}: waiting for the trainer") as line:
                decision = wait_for_trainer(
                    output_dir, run, wait_s, lambda s: line.update(f"{run}: waiting for the trainer, {s:.0f} s")
                )
            if decision.outcome == "rejected":
                print_error(console, "rejected", decision.text)
                return EXIT_USER_ERROR
            console.print(escape(decision.text), highlight=False, soft_wrap=True)  # admitted, or pending and where
            return 0

        guard(console, debug, body)

    @runs_app.command("evict", short_help="Evict a run from a running main job.")
    def runs_evict(
        output_dir: Annotated[Path, typer.Argument(help="the main job's output folder")],
        run_id: Annotated[str, typer.Argument(help="the run to evict, e.g. run_fast")],
        reason: Annotated[str, typer.Option(metavar="TEXT", help="why; written to the run's control/evicted.txt")],
        debug: Annotated[bool, typer.Option(help=DEBUG_HELP)] = False,
    ) -> None:
        """Evict a run: its orchestrator stops and the trainer frees its slot."""

        def body() -> int:
            from rlplex.mainjob.actions import evict_run

            console.print(escape(evict_run(output_dir, run_id, reason)), highlight=False)
            return 0

        guard(console, debug, body)

    @app.command("dashboard", short_help="A live web dashboard of a job's folder (main, control-plane or train).")
    def dashboard(
        output_dir: Annotated[Path, typer.Argument(help="the job's output folder")],
        port: Annotated[
            int, typer.Option(metavar="PORT", help="port to listen on (0: any free port; the link names it)")
        ] = 0,
        host: Annotated[
            str,
            typer.Option(metavar="ADDRESS", help="address to listen on; another than loopback lets other machines in"),
        ] = "127.0.0.1",
        allow_actions: Annotated[
            bool, typer.Option(help="the page may add and evict runs and stop the job (each asks for confirmation)")
        ] = False,
        debug: Annotated[bool, typer.Option(help=DEBUG_HELP)] = False,
    ) -> None:
        """Serve a live page of the job: its state, ETA, runs, learning curves, nodes and event
        log, read from its folder. Prints the link (with the job's dashboard token) once; every
        request without the token is refused. Ctrl-C ends it; the job goes on."""

        def body() -> int:
            from rlplex.config import validate_config
            from rlplex.dashboard.config import DashboardConfig
            from rlplex.dashboard.server import DashboardServer, is_loopback
            from rlplex.errors import ConfigError

            if not output_dir.is_dir():
                raise ConfigError(f"{output_dir}: no such job folder")
            config = validate_config(
                DashboardConfig,
                {"enabled": True, "host": host, "port": port, "allow_actions": allow_actions},
                source="rlplex dashboard",
            )
            server = DashboardServer.create(output_dir.resolve(), config)
            if not is_loopback(host):
                console.print(f"note: listening on {host}: other machines can reach it (the token still guards it)")
            mode = "actions allowed" if allow_actions else "read-only"
            console.print(f"dashboard of {output_dir} ({mode}): {server.url}", highlight=False, soft_wrap=True)
            server.run()
            return 0

        guard(console, debug, body)

    @app.command("export", short_help="Write a run's newest adapter as a PEFT folder, or merged into the base.")
    def export(
        output_dir: Annotated[Path, typer.Argument(help="the main job's (or a trainer's) output folder")],
        run_id: Annotated[str, typer.Argument(metavar="RUN_ID", help="the run, e.g. run_fast")],
        dest: Annotated[Path, typer.Argument(help="new folder to write (it must not exist, or be empty)")],
        merge: Annotated[
            bool, typer.Option(help="add the adapter into the base weights: a save_pretrained folder, no peft needed")
        ] = False,
        step: Annotated[
            int | None, typer.Option(metavar="N", help="the adapter of step N (default: the newest)")
        ] = None,
        debug: Annotated[bool, typer.Option(help=DEBUG_HELP)] = False,
    ) -> None:
        """Write a run's newest complete adapter (or step N's) to DEST with the base model's
        tokenizer: a PEFT LoRA folder that `PeftModel.from_pretrained` loads, or with --merge a
        model folder that `AutoModelForCausalLM.from_pretrained` loads. Works while the job runs."""

        def body() -> int:
            from rlplex.multirun.export import export_run

            result = export_run(output_dir, run_id, dest, merge=merge, step=step)
            kind = "merged model" if result.merged else "PEFT adapter"
            console.print(
                f"{result.run_id} step {result.step}: {kind} written to {result.dest}", highlight=False, soft_wrap=True
            )
            return 0

        guard(console, debug, body)
