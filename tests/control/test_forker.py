"""The fork server (`rlplex.control.forker`): a forked child is the process its command line would
have started (argv, sys.path[0], stdin, output, environment, `__main__`, exit code, thread count),
and a child asked to die with the server does."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from rlplex.control.forker import ForkRequest, ForkServer
from timing import scaled, wait_for

SCRIPT = """
import json, os, sys, threading
import torch
done = threading.Event()
threading.Thread(target=lambda: (done.wait(), print("joined", flush=True))).start()  # non-daemon: joined at exit
out = {"argv": sys.argv, "path0": sys.path[0], "main": __name__, "stdin": sys.stdin.read(),
       "cwd": os.getcwd(), "env": os.environ.get("PROBE"), "threads": torch.get_num_threads()}
print(json.dumps(out), flush=True)
done.set()
sys.exit(3)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    # The server's own thread count is the machine's default; its children's must follow their env.
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    tmp_path = tmp_path_factory.mktemp("modules")
    probe = "def main(argv):\n    print('called with', argv)\n    return int(argv[0])\n"
    (tmp_path / "probe_call.py").write_text(probe)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *sys.path])
    forker = ForkServer(["torch"], env, new_session=False)
    try:
        assert forker.wait_ready(scaled(60.0))
        yield forker
    finally:
        forker.close()


def request(tmp_path: Path, **fields: object) -> ForkRequest:
    env = {**os.environ, "PROBE": "yes", "OMP_NUM_THREADS": "1"}
    return ForkRequest.model_validate({"env": env, "cwd": str(tmp_path), "log": str(tmp_path / "out.log"), **fields})


def test_a_forked_script_runs_as_python_would_run_it_and_its_exit_code_is_reported(
    server: ForkServer, tmp_path: Path
) -> None:
    script = tmp_path / "sub" / "probe.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    child = server.launch(request(tmp_path, path=str(script), argv=["a", "b"], stdin="config text"))
    assert child.wait(timeout=scaled(30.0)) == 3
    lines = (tmp_path / "out.log").read_text().splitlines()
    seen = json.loads(lines[0])
    assert seen["argv"] == [str(script), "a", "b"]
    assert seen["path0"] == str(script.parent)
    assert seen["main"] == "__main__"
    assert seen["stdin"] == "config text"
    assert (seen["cwd"], seen["env"]) == (str(tmp_path), "yes")
    assert seen["threads"] == 1  # the child's OMP_NUM_THREADS, not the server's default
    assert lines[1] == "joined"  # Python's exit: non-daemon threads joined before the process ends


def test_a_called_function_and_a_module_run_with_their_argv(server: ForkServer, tmp_path: Path) -> None:
    called = server.launch(request(tmp_path, call="probe_call:main", argv=["5", "x"]))
    assert called.wait(timeout=scaled(30.0)) == 5  # what it returned is the exit code, as sys.exit has it
    good = tmp_path / "good.json"
    good.write_text('{"k": 1}')
    module = server.launch(request(tmp_path, module="json.tool", argv=[str(good)], stdout=str(tmp_path / "o.json")))
    assert module.wait(timeout=scaled(30.0)) == 0
    assert json.loads((tmp_path / "o.json").read_text()) == {"k": 1}
    assert "called with ['5', 'x']" in (tmp_path / "out.log").read_text()


def test_children_that_die_with_the_server_die_when_it_closes_and_others_live_on(tmp_path: Path) -> None:
    forker = ForkServer([], dict(os.environ), new_session=False)
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(600)\n")
    killed = forker.launch(request(tmp_path, path=str(script)))
    killed.send_signal(signal.SIGKILL)
    assert killed.wait(timeout=scaled(10.0)) == -signal.SIGKILL  # as Popen.returncode has it
    mortal = forker.launch(request(tmp_path, path=str(script), die_with_server=True))
    survivor = forker.launch(request(tmp_path, path=str(script), new_session=True))
    try:
        # Named as its command line once it runs (setproctitle pads the name with NULs, which psutil reads as '').
        title = f"{sys.executable} {script}"
        wait_for(lambda: " ".join(psutil.Process(survivor.pid).cmdline()).strip() == title, scaled(10.0), title)
        assert os.getpgid(survivor.pid) == survivor.pid and os.getpgid(mortal.pid) != mortal.pid
        forker.close()
        wait_for(lambda: not psutil.pid_exists(mortal.pid) or psutil.Process(mortal.pid).status() == "zombie",
                 scaled(10.0), "the mortal child to die with its server")  # fmt: skip
        assert mortal.poll() is not None
        assert psutil.Process(survivor.pid).is_running()
    finally:
        for pid in (mortal.pid, survivor.pid):
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_request_names_one_target() -> None:
    with pytest.raises(ValueError, match="exactly one of call, module and path"):
        ForkRequest(call="m:f", module="m", env={}, cwd="/")
