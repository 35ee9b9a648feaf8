"""The `rlplex` command run through its typer app in the test process: a child process per case
costs seconds of imports on two cores. tests/test_readme_commands.py runs every command as a real
process; a case that could block (a FIFO read) stays a subprocess with a timeout."""

from __future__ import annotations

import subprocess


def rlplex_in_process(*args: str, width: int | None = None) -> subprocess.CompletedProcess[str]:
    """`rlplex ARGS` as a finished process would report it (exit code, output); `width`: the
    console's columns, as COLUMNS would set them for a child."""
    from typer.testing import CliRunner

    from rlplex.cli import app, console

    saved = console.width
    if width is not None:
        console.width = width
    try:
        result = CliRunner().invoke(app, list(args))
    finally:
        console.width = saved
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(list(args), result.exit_code, result.output, "")
