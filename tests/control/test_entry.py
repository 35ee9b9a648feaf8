"""`python -m rlplex.control.elastic.entry MODULE:FUNCTION`: a function entry point run as a real process,
its config in on stdin as the JSON of its model, its graceful stop by SIGTERM or the environment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from node_helpers import wait_for
from rlplex.control.elastic.entry import STOP_ENV, config_model_of
from rlplex.errors import JobSpecError

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


def start(config: dict[str, object], **env: str) -> subprocess.Popen[str]:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(HERE)]), **env}
    process = subprocess.Popen(
        [sys.executable, "-m", "rlplex.control.elastic.entry", "control_workers:wait_for_stop"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ,
    )  # fmt: skip
    assert process.stdin is not None
    process.stdin.write(json.dumps(config))
    process.stdin.close()
    process.stdin = None  # communicate() must not flush it again
    return process


def finish(process: subprocess.Popen[str], timeout: float = 60.0) -> tuple[int, str]:
    try:
        _out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, err


def test_sigterm_is_the_functions_graceful_stop(tmp_path: Path) -> None:
    out = tmp_path / "waiter.txt"
    process = start({"out": str(out), "seconds": 120})
    try:
        wait_for(lambda: out.exists() and out.read_text() == "ready", 60, "the function to start")
        process.send_signal(signal.SIGTERM)
    finally:
        code, err = finish(process)
    assert code == 0, err
    assert out.read_text() == "stopped"


def test_a_stop_asked_before_the_process_started_is_kept(tmp_path: Path) -> None:
    out = tmp_path / "waiter.txt"
    code, err = finish(start({"out": str(out), "seconds": 120}, **{STOP_ENV: "1"}))
    assert code == 0, err
    assert out.read_text() == "stopped"


def test_a_config_that_does_not_fit_the_model_exits_2_naming_the_field(tmp_path: Path) -> None:
    code, err = finish(start({"out": str(tmp_path / "x"), "secondz": 1}))
    assert code == 2, err
    assert "Traceback" not in err and "field 'secondz'" in err and "field 'seconds'" in err, err
    assert not (tmp_path / "x").exists()


def test_an_entrypoint_must_take_one_annotated_config_model() -> None:
    def untyped(config):  # type: ignore[no-untyped-def]
        return 0

    with pytest.raises(JobSpecError, match="annotated with its pydantic config model"):
        config_model_of(untyped, "m:untyped")
