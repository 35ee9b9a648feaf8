"""Fork servers for the control plane's processes: a process that imports what its children share once
(torch, transformers, the node runtime) and forks each child from that state, so a child starts in
tenths of a second instead of seconds of imports, and restarts as fast.

Two users, one server:
- the local backend's master forks every node of its job from one (`LocalScheduler`): the node
  runtime and the job spec's `preload`; each node in its own session, living on when the server
  (the master) is gone, as a resumed master needs;
- an `ElasticWorker` node forks its training script and node check from one of its own: torch,
  torch.distributed and the entrypoint's module; each child in the node's process group and
  SIGKILLed when the server dies, and the server when the node dies.

The server is `python -m rlplex.control.forker`. It reads JSON lines on stdin: first
`{"preload": [...]}`, answered `{"ready": true}` once imported, then one `ForkRequest` per child;
it answers on stdout `{"pid": N}` per child
(or `{"error": ...}`), and `{"exit": pid, "code": c}` when a child ends (`c` as `Popen.returncode`
has it: negative for a signal). It exits when its stdin closes, that is when its client exits or
dies, however it dies.

A child is forked, not `exec`ed, and becomes what the command line `ForkRequest.command` would
have started: its environment, working directory, fds 0/1/2, `sys.argv`, `sys.path[0]`, fresh
random states and thread count, and its name (`setproctitle`: `ps`, psutil and tests find
processes by it); then its target runs at the module's top level, and it exits as Python exits
(atexit handlers, non-daemon threads joined, streams flushed). The server runs no thread of its
own and no torch op before it forks, as a fork needs; a preloaded module that starts threads at
import does not belong in the preload (the server warns).

Why not `multiprocessing`'s fork server (`rlplex.processes`): that one is shared by every library
child of a process, with the preload of whichever child came first; its children report to the
launcher's resource tracker (whose death unlinks their shared memory) and die with the launcher.
Nodes outlive a killed master and own their shared memory; a script runs the user's `__main__`.
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
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pydantic import BaseModel, model_validator

from rlplex.errors import NodeFailedError


class ForkRequest(BaseModel):
    """One child: exactly one target (`call` "module:function" called with `argv`, `module` run as
    `python -m`, `path` run as `python PATH`), and how it is set up."""

    call: str | None = None
    module: str | None = None
    path: str | None = None
    argv: list[str] = []
    env: dict[str, str]
    cwd: str
    title: str = ""  # the command line it shows; `command` when empty
    log: str | None = None  # stdout and stderr appended here; else the server's stderr
    stdout: str | None = None  # stdout alone written here (after `log`)
    stdin: str | None = None  # the child's stdin holds this text; else /dev/null
    new_session: bool = False  # its own session and process group (a node), else the server's
    die_with_server: bool = False  # SIGKILL when the server exits (scripts), else lives on (nodes)

    @model_validator(mode="after")
    def _one_target(self) -> ForkRequest:
        if sum(x is not None for x in (self.call, self.module, self.path)) != 1:
            raise ValueError("a fork request names exactly one of call, module and path")
        return self

    def command(self) -> list[str]:
        """The command line that would start the same process."""
        if self.call is not None:
            return [sys.executable, "-m", self.call.split(":", 1)[0], *self.argv]
        if self.module is not None:
            return [sys.executable, "-m", self.module, *self.argv]
        return [sys.executable, str(self.path), *self.argv]


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


def _as_fresh_process(env: Mapping[str, str]) -> None:
    """What a new process would have that forked siblings share with the server: numpy's and
    torch's global random states (Python's `random` reseeds itself after a fork) and torch's
    thread count (OpenMP read OMP_NUM_THREADS when the server loaded torch, not now)."""
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.seed()
        threads = env.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))


def _point(fd: int, path: str, flags: int) -> None:
    opened = os.open(path, flags, 0o644)
    os.dup2(opened, fd)
    os.close(opened)


def _become(request: ForkRequest, server_pid: int, server_fds: tuple[int, ...]) -> None:
    """In the forked child: become the process `request.command()` would have started."""
    from setproctitle import setproctitle

    from rlplex.processes import die_with_parent

    # Before the environment changes: the title may take the space of the original environ.
    setproctitle(request.title or " ".join(request.command()))
    if request.new_session:
        os.setsid()
    if request.die_with_server:
        die_with_parent(signal.SIGKILL, server_pid)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in server_fds:
        os.close(fd)
    if request.stdin is None:
        _point(0, os.devnull, os.O_RDONLY)
    else:
        with tempfile.TemporaryFile() as file:  # unlinked at once; the child's fd 0 keeps it
            file.write(request.stdin.encode())
            file.flush()
            os.lseek(file.fileno(), 0, os.SEEK_SET)
            os.dup2(file.fileno(), 0)
    if request.log is not None:
        _point(1, request.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(1, 2)
    else:
        os.dup2(2, 1)  # the server pointed its fd 1 at its stderr; a child without a log writes there
    if request.stdout is not None:
        _point(1, request.stdout, os.O_WRONLY | os.O_TRUNC | os.O_CREAT)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    _as_fresh_process(request.env)
    command = request.command()
    if request.path is not None:
        sys.argv = [request.path, *request.argv]
        sys.path[0] = os.path.dirname(os.path.realpath(request.path))
    else:
        sys.argv = [command[2], *request.argv]
        sys.path[0] = os.getcwd()


def _preload(modules: Sequence[str]) -> None:
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as error:  # the child imports it again, and its log then says why it fails
            print(f"rlplex fork server: preloading {module} failed: {error!r}", file=sys.stderr, flush=True)


def serve() -> ForkRequest | None:
    """The server's loop: fork a child per request, report each exit. Returns None in the server
    when its stdin ends, and the child's request in each forked child, set up to run it."""
    global _requests_fd, _answers_fd
    _requests_fd, _answers_fd = os.dup(0), os.dup(1)
    _point(0, os.devnull, os.O_RDONLY)
    os.dup2(2, 1)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    server_pid = os.getpid()
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
            return None  # the client is gone
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            message = json.loads(line)
            if "preload" in message:
                _preload(message["preload"])
                if threading.active_count() > 1:
                    print(f"rlplex fork server: preloading {message['preload']} started threads; forking "
                          "from it may deadlock", file=sys.stderr, flush=True)  # fmt: skip
                _write({"ready": True})
                continue
            request = ForkRequest.model_validate(message)
            try:
                pid = os.fork()
            except OSError as error:
                _write({"error": f"fork failed: {error}"})
                continue
            if pid == 0:
                try:
                    _become(request, server_pid, (wake_r, wake_w, _requests_fd, _answers_fd))
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    os._exit(70)
                return request
            _write({"pid": pid})
            _reap()


def run(request: ForkRequest) -> Any:
    """In the child, at the top level: run the target; what `sys.exit` takes."""
    if request.call is not None:
        module, _, function = request.call.partition(":")
        return getattr(importlib.import_module(module), function)(request.argv)
    import runpy

    if request.module is not None:
        runpy.run_module(request.module, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(str(request.path), run_name="__main__")
    return 0


# ---- the client's side ---------------------------------------------------------------------------
class ChildProcess(Protocol):
    """What the control plane needs of a child, forked or `Popen`ed."""

    pid: int

    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class ForkServer:
    """A client's handle on its fork server: `launch` a child, learn its exit code.

    The server starts at construction and imports its preload while the client goes on; the
    first `launch` waits for it. A reader thread collects the server's answers. `command` starts
    it (default `python -m rlplex.control.forker`; an ElasticWorker's adds its orphan guard).
    """

    def __init__(
        self,
        preload: Sequence[str],
        env: Mapping[str, str],
        command: Sequence[str] = (),
        new_session: bool = True,
        start_timeout_s: float = 120.0,
    ) -> None:
        self._start_timeout_s = start_timeout_s
        self._process = subprocess.Popen(
            list(command) or [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env=dict(env), start_new_session=new_session,
        )  # fmt: skip
        self._launching = threading.Lock()  # one request in flight: answers come in request order
        self._changed = threading.Condition()
        self._answers: list[dict[str, Any]] = []  # to launches: {"pid": N} or {"error": why}
        self._exits: dict[int, int] = {}
        self._ready = self._closed = False
        self._send({"preload": list(preload)})
        self._reader = threading.Thread(target=self._read, name="fork-server", daemon=True)
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
                elif "ready" in message:
                    self._ready = True
                else:
                    self._answers.append(message)
                self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether the server has imported its preload (waiting up to `timeout_s` for it)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._ready or self._closed, timeout=timeout_s) and self._ready

    def launch(self, request: ForkRequest) -> ForkedProcess:
        """Fork the child the request describes."""
        what = request.title or " ".join(request.command())
        deadline = time.monotonic() + self._start_timeout_s
        with self._launching:
            try:
                self._send(request.model_dump(exclude_defaults=True))
            except OSError as error:
                raise NodeFailedError(f"the fork server is gone ({error}); {what}") from None
            with self._changed:
                return ForkedProcess(self, self._answer(deadline, what))

    def _answer(self, deadline: float, what: str) -> int:
        """The server's answer to the one request in flight (the caller holds the condition)."""
        while not self._answers:
            if self._closed:
                raise NodeFailedError(f"the fork server exited ({self._process.wait()}); {what}")
            if not self._changed.wait(timeout=max(0.0, deadline - time.monotonic())):
                raise NodeFailedError(f"the fork server forked nothing in {self._start_timeout_s:g} s; {what}")
        answer = self._answers.pop(0)
        if "error" in answer:
            raise NodeFailedError(f"the fork server: {answer['error']}; {what}")
        return int(answer["pid"])

    def exit_code(self, pid: int, timeout_s: float = 0.0) -> int | None:
        """The exit code of a child this server forked, once the server has reaped it (None before)."""
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
        """End the server (children that die with it die now; nodes live on)."""
        if self._process.stdin is not None:
            with contextlib.suppress(OSError):
                self._process.stdin.close()
        try:
            self._process.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(timeout=5.0)


class ForkedProcess:
    """A child of a fork server, with the part of `Popen`'s interface that `ChildProcess` names.
    Its exit code is what the server reported; a server gone without reporting it leaves it
    unknown (None) unless the process is gone too, then it reads as -9."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
            if self.returncode is None and not self.server.running and not _exists(self.pid):
                self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            remaining = 3600.0 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            self.server.exit_code(self.pid, timeout_s=min(remaining, 0.5))
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # a reaped pid may be someone else's by now
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _exists(pid: int) -> bool:
    """Whether the process runs (a zombie has ended: nobody has reaped it yet)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


if __name__ == "__main__":
    _request = serve()
    if _request is None:
        os._exit(0)  # the server: nothing to flush, and torch's teardown would take a second
    sys.exit(run(_request))
