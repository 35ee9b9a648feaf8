"""Serving the dashboard with uvicorn: `rlplex dashboard OUT` in the foreground, or a job's
master on a thread of its own (`DashboardServer.start`).

The socket is bound here, before uvicorn starts, so that `--port 0` gives a port the link can
name at once. Loopback unless the host is given: the dashboard shows everything about the job
(and, with actions allowed, can stop it); a token keeps out other users of the same machine,
a loopback address keeps out other machines.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from rlplex.dashboard.app import build_app
from rlplex.dashboard.auth import dashboard_token
from rlplex.dashboard.config import DashboardConfig
from rlplex.dashboard.sources import ViewSource
from rlplex.errors import ConfigError


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ConfigError(f"dashboard: cannot listen on {host}:{port}: {error.strerror or error}") from None
    sock.listen(64)
    sock.set_inheritable(False)
    return sock


@dataclass
class DashboardServer:
    """A bound socket and the uvicorn server that will serve the dashboard on it."""

    server: uvicorn.Server
    sock: socket.socket
    url: str  # the link with the token: printed once, never logged
    source: ViewSource
    _thread: threading.Thread | None = None

    @classmethod
    def create(cls, output_dir: Path, config: DashboardConfig, source: ViewSource | None = None) -> DashboardServer:
        token = dashboard_token(output_dir)
        source = source or ViewSource(output_dir)
        sock = bind(config.host, config.port)
        port = sock.getsockname()[1]
        app = build_app(source, token, config.allow_actions)
        # No access log: every line would be a poll, and the first would carry the token.
        settings = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", server_header=False)
        if source.reads_folder:
            # Read the folder once while the link is being opened: the first page then finds the
            # progress CSVs parsed (a cold read of 16 runs x 1,000 steps takes 0.2-0.4 s).
            threading.Thread(target=source.read, name="rlplex-dashboard-warm", daemon=True).start()
        shown = f"[{config.host}]" if ":" in config.host else config.host
        return cls(uvicorn.Server(settings), sock, f"http://{shown}:{port}/?token={token}", source)

    def run(self) -> None:
        """Serve until SIGINT or SIGTERM (uvicorn's handlers), in this thread."""
        try:
            self.server.run(sockets=[self.sock])
        finally:
            self.sock.close()

    def start(self) -> None:
        """Serve on a daemon thread (a job's master); `close()` ends it."""
        self._thread = threading.Thread(target=self.run, name="rlplex-dashboard", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
