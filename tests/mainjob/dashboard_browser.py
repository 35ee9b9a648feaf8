"""The dashboard as a person sees it: `rlplex dashboard OUT` in its own process, opened in headless
Chromium (Debian's package, driven by Playwright: no browser download). Where no browser can
run, `DashboardPage` checks the same things through the page's JSON, and `browser_missing()`
says why, for the test that skips on it. `answer_one_add` plays a running job's master for the
page's "Add a run" on a folder without a job."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from rlplex.mainjob.driver import accept_requests
from rlplex.mainjob.registry import pending_requests
from rlplex.models.spec import ModelSpec
from timing import scaled, wait_for

CHROMIUM = Path(os.environ.get("RLPLEX_CHROMIUM", "/usr/bin/chromium"))


# A run's TOML `answer_one_add` admits: its own model, so a folder without the job's file will do.
RUN_TOML = 'env = { name = "reverse" }\nmax_steps = 2\nbatch_size = 8\ngroup_size = 4\n[model]\nname = "some/model"\n'


class Master:
    """A job's master as `accept_requests` uses it: the roles it would scale, recorded."""

    def __init__(self) -> None:
        self.scaled: list[tuple[str, int]] = []

    def scale_role(self, role: str, count: int) -> None:
        self.scaled.append((role, count))


def answer_one_add(out: Path, master: Master, model: str = "some/model") -> threading.Thread:
    """The master's loop on a thread, for the next add request in `out`: the real checks, the
    registry and the answer file (an add waits for that answer)."""

    def loop() -> None:
        wait_for(lambda: pending_requests(out), 30, "an add request")
        accept_requests(master, out, ModelSpec(name=model))  # type: ignore[arg-type]

    thread = threading.Thread(target=loop, name="stand-in-master", daemon=True)
    thread.start()
    return thread


def browser_missing() -> str | None:
    """Why no browser can open the dashboard here (None: one can)."""
    if not CHROMIUM.exists():
        return f"no Chromium at {CHROMIUM}: `apt-get install chromium` (.ci/run does where apt works)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as error:
        return f"playwright does not import ({error}): pip install -r requirements-dev.txt"
    return None


class DashboardPage:
    """The open page (or, without a browser, its JSON) of a dashboard at `url`."""

    def __init__(self, url: str, page: Any | None) -> None:
        self.url, self.page = url, page
        self.base = url.split("/?")[0]
        self.token = url.split("token=")[1]

    def _runs(self) -> dict[str, dict[str, Any]]:
        data = httpx.get(f"{self.base}/api/view", headers={"authorization": f"Bearer {self.token}"}).json()
        return {run["id"]: run for run in data["runs"]}

    def run_rows(self) -> dict[str, dict[str, str]]:
        """Each run's row as shown: state, points of its curve, restarts."""
        if self.page is None:
            return {run_id: {"state": run["state"], "points": str(len(run["curve"]["step"])),
                             "restarts": str(run["restarts"])} for run_id, run in self._runs().items()}  # fmt: skip
        return dict(self.page.evaluate(
            "Object.fromEntries([...document.querySelectorAll('#runs tbody tr')].map((row) => [row.dataset.run, "
            "{state: row.dataset.state, points: row.dataset.points, restarts: row.dataset.restarts}]))"
        ))  # fmt: skip

    def wait(self, what: str, check: Any, timeout_s: float) -> dict[str, dict[str, str]]:
        """Wait until `check(rows)` holds of the page's run rows (the page redraws by itself:
        never reloaded), with the rows as the failure message."""
        rows: dict[str, dict[str, str]] = {}

        def holds() -> bool:
            nonlocal rows
            rows = self.run_rows()
            return bool(check(rows))

        try:
            wait_for(holds, timeout_s, f"the dashboard to show {what}", interval=0.2)
        except AssertionError as error:
            raise AssertionError(f"{error}; the page's runs: {rows}") from None
        return rows


@contextlib.contextmanager
def open_dashboard(out: Path, log_path: Path, *flags: str) -> Iterator[DashboardPage]:
    """`rlplex dashboard OUT` (OUT may still be empty: a job about to start) on a free loopback
    port, its link opened in headless Chromium (when there is one); the browser and the server
    are gone on the way out."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "400"}
    with open(log_path, "w") as log:
        # The folder by its name from its parent: `job_processes(out)` must not count the dashboard.
        command = [sys.executable, "-m", "rlplex.cli", "dashboard", out.name, "--port", "0", *flags]
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out.parent)
    try:
        wait_for(lambda: "token=" in log_path.read_text() or server.poll() is not None, 60, "the dashboard's link")
        assert server.poll() is None, log_path.read_text()
        url = log_path.read_text().split(": http", 1)[1].split()[0]
        url = "http" + url
        # Without the token, nothing: not the page, not the JSON, not the scripts.
        base = url.split("/?")[0]
        for path in ("/", "/api/view", "/static/dashboard.js"):
            assert httpx.get(base + path).status_code == 401, path
        if browser_missing() is not None:
            yield DashboardPage(url, None)
            return
        from playwright.sync_api import sync_playwright

        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
            try:
                # bypass_csp: Playwright's waits evaluate strings, which the page's CSP forbids.
                page = browser.new_page(bypass_csp=True)
                page.set_default_timeout(scaled(30) * 1000)
                page.goto(url)
                page.wait_for_function("Number(document.body.dataset.updates || 0) >= 1")
                assert "token=" not in page.url  # the link's token left the address bar
                yield DashboardPage(url, page)
            finally:
                browser.close()
    finally:
        server.terminate()
        try:
            server.wait(scaled(10))
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
