"""The local backend's node fork server: one per master, it imports what the job's nodes share once
(the node runtime, and the job spec's `preload`: torch, transformers) and forks every node from
that state, so a node starts in tenths of a second instead of seconds of imports, and restarts
as fast.

The server is `python -m rlplex.control.backends.node_forker`, started by the master in its own
session (a Ctrl-C in the master's terminal is the master's to handle). It reads JSON lines on
stdin: first `{"preload": [...]}`, then one `{"argv", "env", "cwd", "log", "title"}` per node;
it answers on stdout `{"pid": N}` per node (or `{"error": ...}`), and `{"exit": pid, "code": c}`
when a node it forked ends (`c` as `Popen.returncode` has it: negative for a signal). It exits
when its stdin closes, that is when the master exits or dies, however it dies; its nodes live
on, as they must for a resumed master.

Each node is forked, not `exec`ed: it calls `setsid()` (its own session and process group,
which `kill` signals as a whole), points fds 0/1/2 at /dev/null and its log, takes the
environment and working directory of the request, and names itself with `setproctitle` as the
command line it would have had (`ps`, and tests, find nodes by it). The server runs no thread
of its own and no torch op before it forks, as a fork needs; a preloaded module that starts
threads at import does not belong in `preload`.

Why not `multiprocessing`'s fork server (`rlplex.processes`): that one is shared by every library
child of a process, with the preload of whichever child came first, its children report to the
launcher's resource tracker (whose death unlinks their shared memory) and die with the launcher;
nodes outlive a killed master and own their shared memory.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlplex.errors import NodeFailedError

# Always preloaded: what every node runs.
NODE_MODULE = "rlplex.control.node.runtime"


# ---- the server ----------------------------------------------------------------------------------
# The server's private copies of its stdin and stdout: fds 0 and 1 point elsewhere, so that
# nothing a preloaded module prints or reads touches the protocol.
_requests_fd, _answers_fd = -1, -1


def _write(message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(_answers_fd, data) :]


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _write({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _reseed() -> None:
    """Fresh global random states, as a new process has: forked siblings would share the server's
    (numpy's and torch's; Python's `random` reseeds itself after a fork)."""
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()


def _run_node(request: dict[str, Any], server_fds: tuple[int, ...]) -> None:
    """In the forked child: become the node process the request describes, then run it."""
    try:
        from setproctitle import setproctitle

        # Before the environment changes: the title may take the space of the original environ.
        setproctitle(request["title"])
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in server_fds:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(null)
        os.close(log)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _reseed()
        sys.argv = [request["title"].split(" ", 1)[0], *request["argv"]]
        from rlplex.control.node.runtime import main

        main(request["argv"])  # exits the process itself
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(70)


def _preload(modules: Sequence[str]) -> None:
    for module in [NODE_MODULE, *modules]:
        try:
            importlib.import_module(module)
        except Exception as error:  # the node imports it again, and its log then says why it fails
            print(f"rlplex node fork server: preloading {module} failed: {error!r}", file=sys.stderr, flush=True)


def serve() -> None:
    """The server's loop: fork a node per request, report each exit, leave at the end of stdin."""
    global _requests_fd, _answers_fd
    _requests_fd, _answers_fd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pending = b""
    while True:
        try:
            ready, _, _ = select.select([_requests_fd, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap()
        if _requests_fd not in ready:
            continue
        chunk = os.read(_requests_fd, 65536)
        if not chunk:
            return  # the master is gone: the nodes live on
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if "preload" in request:
                _preload(request["preload"])
                if threading.active_count() > 1:
                    print(f"rlplex node fork server: preloading {request['preload']} started threads; forking "
                          "nodes from it may deadlock", file=sys.stderr, flush=True)  # fmt: skip
                continue
            try:
                pid = os.fork()
            except OSError as error:
                _write({"error": f"fork failed: {error}"})
                continue
            if pid == 0:
                _run_node(request, (wake_r, wake_w, _requests_fd, _answers_fd))
            _write({"pid": pid})
            _reap()


# ---- the master's side ---------------------------------------------------------------------------
class NodeForker:
    """The master's handle on its node fork server: `launch` a node, learn its exit code.

    The server starts at construction and imports its preload while the master goes on; the
    first `launch` waits for it. A reader thread collects the server's answers.
    """

    def __init__(self, preload: Sequence[str], env: Mapping[str, str], start_timeout_s: float = 120.0) -> None:
        self._start_timeout_s = start_timeout_s
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(env),
            start_new_session=True,
        )  # fmt: skip
        self._launching = threading.Lock()  # one request in flight: answers come in request order
        self._changed = threading.Condition()
        self._answers: list[dict[str, Any]] = []  # to launches: {"pid": N} or {"error": why}
        self._exits: dict[int, int] = {}
        self._closed = False
        self._send({"preload": list(preload)})
        self._reader = threading.Thread(target=self._read, name="node-forker", daemon=True)
        self._reader.start()

    def _send(self, message: dict[str, Any]) -> None:
        assert self._process.stdin is not None
        self._process.stdin.write((json.dumps(message) + "\n").encode())
        self._process.stdin.flush()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            message = json.loads(line)
            with self._changed:
                if "exit" in message:
                    self._exits[int(message["exit"])] = int(message["code"])
                else:
                    self._answers.append(message)
                self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def launch(self, argv: Sequence[str], env: Mapping[str, str], log: Path, title: str) -> int:
        """Fork a node running `rlplex.control.node.runtime.main(argv)`; its pid."""
        request = {"argv": list(argv), "env": dict(env), "cwd": os.getcwd(), "log": str(log), "title": title}
        deadline = time.monotonic() + self._start_timeout_s
        with self._launching:
            try:
                self._send(request)
            except OSError as error:
                raise NodeFailedError(f"the node fork server is gone ({error}); {title}") from None
            with self._changed:
                return self._answer(deadline, title)

    def _answer(self, deadline: float, title: str) -> int:
        """The server's answer to the one request in flight (the caller holds the condition)."""
        while not self._answers:
            if self._closed:
                raise NodeFailedError(f"the node fork server exited ({self._process.wait()}); {title}")
            if not self._changed.wait(timeout=max(0.0, deadline - time.monotonic())):
                raise NodeFailedError(f"the node fork server forked nothing in {self._start_timeout_s:g} s; {title}")
        answer = self._answers.pop(0)
        if "error" in answer:
            raise NodeFailedError(f"the node fork server: {answer['error']}; {title}")
        return int(answer["pid"])

    def exit_code(self, pid: int, timeout_s: float = 0.0) -> int | None:
        """The exit code of a node this server forked, once the server has reaped it (None before)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while pid not in self._exits and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(timeout=remaining)
            return self._exits.get(pid)

    @property
    def running(self) -> bool:
        return not self._closed

    def close(self) -> None:
        """End the server (its nodes live on)."""
        if self._process.stdin is not None:
            with contextlib.suppress(OSError):
                self._process.stdin.close()
        try:
            self._process.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(timeout=5.0)


if __name__ == "__main__":
    serve()
