"""The job token: the HMAC key of every control connection of a job, and who may see it.

It lives in `<output_dir>/job.token` (mode 0600), written once by the job's first master. Nodes
read it from there (both backends: a Ray actor gets no token argument, which Ray's state API and
dashboard would show). User code (a role's entry point and every process it starts) finds it in
its environment as RLPLEX_JOB_TOKEN only when its role sets `needs_job_token = true`: the
token lets its holder drive every node of the job, so code that does not need it must not
carry it into its logs, its subprocesses or a crash report.

This module imports nothing heavy: every node process loads it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from rlplex.errors import ConfigError

TOKEN_FILE = "job.token"
TOKEN_ENV = "RLPLEX_JOB_TOKEN"


def write_token(output_dir: Path) -> bytes:
    token = secrets.token_bytes(32)
    path = output_dir / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to an existing file
        os.write(fd, token.hex().encode())
    finally:
        os.close(fd)
    return token


def read_token(output_dir: str | Path) -> bytes:
    path = Path(output_dir) / TOKEN_FILE
    try:
        return bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: cannot read the job token: {error}") from None


def expose_token(token: bytes, needed: bool) -> None:
    """Put the token in this process's environment (and so its children's) only when the role asks."""
    if needed:
        os.environ[TOKEN_ENV] = token.hex()
    else:
        os.environ.pop(TOKEN_ENV, None)
