"""The dashboard's web app: one page, its static files, the view as JSON, and the actions.

```
browser ──GET /?token=T──▶ TokenGate ──303 + cookie──▶ browser
        ──GET /, /static/*─▶ TokenGate ─▶ the page, uPlot (shipped in the package)
        ──GET /api/view?have=run_a:120,...─▶ ViewSource.read() (one folder read per 0.5 s)
                                              └▶ snapshot(): only the curve points the page lacks
        ──POST /api/add, /api/evict, /api/stop──▶ (with --allow-actions) the functions the CLI calls
```

Reading the folder blocks (SQLite, CSVs), so it runs in Starlette's thread pool, never on the
event loop; so does an add, which waits for the master's answer (seconds) as `rlplex runs add`
does. A stop waits for the job to stop (minutes, as `rlplex stop` does), so it runs on a
thread of its own and the page follows the job's state.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from rlplex.dashboard.auth import TokenGate
from rlplex.dashboard.snapshot import snapshot
from rlplex.dashboard.sources import ViewSource
from rlplex.errors import RlplexError, WaitTimeoutError

STATIC = Path(__file__).parent / "static"
MAX_ACTION_BYTES = 64 << 10
STOP_TIMEOUT_S = 600.0
ADD_TIMEOUT_S = 30.0  # `rlplex runs add --timeout-s`'s default
PAGE_TOML, PAGE_RUN_ID = "the page's TOML", "run id"  # what an add's errors call the form's fields


def parse_have(text: str) -> dict[str, int]:
    """`run_a:120,run_b:98` -> {"run_a": 120, "run_b": 98}; malformed parts are dropped (the page
    then gets those curves whole)."""
    have = {}
    for part in text.split(","):
        run, _, count = part.partition(":")
        if run and count.isdigit():
            have[run] = int(count)
    return have


def _stop_function(kind: str) -> Callable[[Path], str]:
    """`rlplex stop`'s function for a main job, `rlplex job stop`'s for a control-plane job."""
    if kind == "main":
        from rlplex.mainjob.driver import stop_main_job

        return lambda folder: stop_main_job(folder, Console(file=io.StringIO()), STOP_TIMEOUT_S)
    if kind == "job":
        from rlplex.control.job.master import stop_job

        return lambda folder: stop_job(folder, STOP_TIMEOUT_S)
    raise RlplexError(f"a {kind} folder has no job to stop here; stop it where it runs (Ctrl-C)")


class Dashboard:
    """The app's state: the view source, whether actions are allowed, what the actions said."""

    def __init__(self, source: ViewSource, allow_actions: bool) -> None:
        self.source = source
        self.allow_actions = allow_actions
        self.messages: list[str] = []  # the actions' outcomes, newest last, shown on the page
        self._stopping: threading.Thread | None = None

    async def page(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html")

    async def view(self, request: Request) -> Response:
        view = await run_in_threadpool(self.source.read)
        have = parse_have(request.query_params.get("have", ""))
        data = snapshot(view, self.source.kind, have, self.allow_actions)
        data["messages"] = self.messages[-10:]
        return JSONResponse(data)

    async def _body(self, request: Request) -> dict[str, Any] | Response:
        if not self.allow_actions:
            return JSONResponse({"error": "actions are off: start the dashboard with --allow-actions"}, 403)
        raw = await request.body()
        if len(raw) > MAX_ACTION_BYTES:
            return JSONResponse({"error": "request too large"}, 413)
        try:
            data = await request.json() if raw else {}
        except ValueError:
            return JSONResponse({"error": "the request is not JSON"}, 400)
        return data if isinstance(data, dict) else JSONResponse({"error": "expected a JSON object"}, 400)

    async def add(self, request: Request) -> Response:
        data = await self._body(request)
        if isinstance(data, Response):
            return data
        if self.source.kind != "main":
            return JSONResponse({"error": f"a {self.source.kind} folder has no runs to add to"}, 400)
        run_id, toml_text = str(data.get("run", "")), data.get("toml")
        if not isinstance(toml_text, str):
            return JSONResponse({"error": "toml: expected the run's TOML as text"}, 400)
        from rlplex.config import parse_toml
        from rlplex.mainjob.actions import add_run

        try:
            config = parse_toml(toml_text, PAGE_TOML)
            accepted, answer = await run_in_threadpool(
                add_run, self.source.output_dir, run_id, config, PAGE_TOML, PAGE_RUN_ID, ADD_TIMEOUT_S
            )
        except WaitTimeoutError as error:  # the request stays: a master that comes back answers it
            return JSONResponse({"error": str(error)}, 504)
        except RlplexError as error:
            return JSONResponse({"error": str(error)}, 400)
        if not accepted:
            self.messages.append(f"add {run_id}: rejected: {answer}")
            return JSONResponse({"error": answer}, 400)
        # As `rlplex runs add --wait-s 0`: the trainer's decision shows in the run's row.
        text = f"add {run_id}: accepted by the job: {answer}"
        self.messages.append(text)
        return JSONResponse({"text": text})

    async def evict(self, request: Request) -> Response:
        data = await self._body(request)
        if isinstance(data, Response):
            return data
        if self.source.kind != "main":
            return JSONResponse({"error": f"a {self.source.kind} folder has no runs to evict"}, 400)
        from rlplex.mainjob.actions import evict_run

        try:
            text = await run_in_threadpool(
                evict_run, self.source.output_dir, str(data.get("run", "")), str(data.get("reason", ""))
            )
        except RlplexError as error:
            return JSONResponse({"error": str(error)}, 400)
        self.messages.append(text)
        return JSONResponse({"text": text})

    async def stop(self, request: Request) -> Response:
        data = await self._body(request)
        if isinstance(data, Response):
            return data
        try:
            stop = _stop_function(self.source.kind)
        except RlplexError as error:
            return JSONResponse({"error": str(error)}, 400)
        if self._stopping is not None and self._stopping.is_alive():
            return JSONResponse({"text": "a stop is already under way"}, 202)

        def run() -> None:
            try:
                self.messages.append(f"stop: {stop(self.source.output_dir)}")
            except RlplexError as error:
                self.messages.append(f"stop failed: {error}")

        self._stopping = threading.Thread(target=run, name="rlplex-dashboard-stop", daemon=True)
        self._stopping.start()
        self.messages.append("stop requested: the job checkpoints and writes its report")
        return JSONResponse({"text": "stop requested"}, 202)


def build_app(source: ViewSource, token: str, allow_actions: bool = False) -> TokenGate:
    """The dashboard as an ASGI app: every request passes the token gate first."""
    dashboard = Dashboard(source, allow_actions)
    app = Starlette(
        routes=[
            Route("/", dashboard.page),
            Route("/favicon.ico", lambda request: Response(status_code=204)),
            Route("/api/view", dashboard.view),
            Route("/api/add", dashboard.add, methods=["POST"]),
            Route("/api/evict", dashboard.evict, methods=["POST"]),
            Route("/api/stop", dashboard.stop, methods=["POST"]),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ]
    )
    return TokenGate(app, token)
