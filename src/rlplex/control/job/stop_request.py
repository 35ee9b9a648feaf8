"""Asking a running job to stop from another process (`rlplex stop`, `rlplex job stop`).

The request is a file in the job's folder, `requests/stop`, holding the reason. The master's
control loop reads it each pass (`PrimeMaster.wait`, the Ray master actor, the main job's loop),
stops the job gracefully with that reason, and removes the file once the job has stopped (the
main job after its report), so the asker waits for the file to go. A file, not an RPC: whoever
may write the job's folder may stop the job, no token is needed, and a master resumed after a
crash still finds the request.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

from rlplex.errors import ConfigError, WaitTimeoutError
from rlplex.io.safe_files import read_regular_text, write_file_atomic

STOP_REQUEST_FILE = "requests/stop"


def request_stop(output_dir: Path, reason: str) -> Path:
    path = output_dir / STOP_REQUEST_FILE
    path.parent.mkdir(exist_ok=True)
    write_file_atomic(path, reason.encode())
    return path


def stop_requested(output_dir: Path) -> str | None:
    """The reason of a pending stop request, or None."""
    path = output_dir / STOP_REQUEST_FILE
    if not os.path.lexists(path):
        return None
    try:
        return read_regular_text(path).strip() or "stopped by a stop request"
    except OSError as error:  # still a stop request, whatever was put there
        return f"stopped by a stop request ({error})"


def clear_stop_request(output_dir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (output_dir / STOP_REQUEST_FILE).unlink()


def wait_for_stop(request: Path, timeout_s: float, master_alive: Callable[[], bool]) -> None:
    """Wait until the master has stopped the job (it removes `request`)."""
    deadline = time.monotonic() + timeout_s
    while os.path.lexists(request):
        if time.monotonic() > deadline:
            raise WaitTimeoutError(f"{request}: the job's master did not stop the job within {timeout_s:g} s")
        if not master_alive():
            raise ConfigError(f"{request.parents[1]}: the job's master died before stopping the job")
        time.sleep(0.2)
