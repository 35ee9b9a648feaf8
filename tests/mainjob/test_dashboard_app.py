"""The dashboard's app on a job folder as a running job leaves it (benchmarks.dashboard_latency's
synthetic one): the token on every route, the view's JSON and its incremental curves, the
actions through the CLI's functions, and `rlplex dashboard` itself on loopback."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from benchmarks.dashboard_latency import append_step, make_job, progress_line
from dashboard_browser import RUN_TOML, Master, answer_one_add
from starlette.testclient import TestClient

import rlplex.dashboard.app as app_module
from rlplex.control.job.store import SqliteStateStore
from rlplex.control.job.token import read_token
from rlplex.dashboard.app import build_app, parse_have
from rlplex.dashboard.auth import TokenGate, cookie_name, dashboard_token
from rlplex.dashboard.sources import ViewSource, classic_view, folder_kind
from rlplex.mainjob.progress_rows import read_progress_rows
from rlplex.mainjob.registry import pending_requests, read_registry
from rlplex.multirun.rundir import RunDir, write_eviction
from timing import scaled, wait_for

ROUTES = ["/", "/api/view", "/static/dashboard.js", "/static/uplot/uPlot.iife.min.js", "/static/none", "/nowhere"]


@pytest.fixture
def job(tmp_path: Path) -> Path:
    out = tmp_path / "job"
    make_job(out, runs=3, steps=5, max_steps=8)
    write_eviction(RunDir(out / "runs", "run_02"), "bad rollouts: <b>not html</b>")
    (out / "runs" / "run_00" / "eval").mkdir()
    (out / "runs" / "run_00" / "eval" / "progress.csv").write_text("step,eval/accuracy_t0\n0,0.25\n4,0.5\n")
    return out


def reward(run: int, step: int) -> float:
    return float(progress_line(run, step).split(",")[1])


def client(out: Path, allow_actions: bool = False) -> TestClient:
    # min_interval_s 0: each request reads the folder (the tests change it between requests).
    source = ViewSource(out, min_interval_s=0.0)
    return TestClient(build_app(source, dashboard_token(out), allow_actions), base_url="http://127.0.0.1:8765")


def redirect_of(app: TokenGate, path: str, query: str) -> str:
    """The Location the gate answers a raw request with (an HTTP client would take "//host" as a host)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "query_string": query.encode(), "headers": [],
             "server": ("127.0.0.1", 8765)}  # fmt: skip
    asyncio.run(app(scope, receive, send))
    return dict(sent[0]["headers"])[b"location"].decode()


def test_every_route_refuses_a_request_without_the_token(job: Path) -> None:
    token = dashboard_token(job)
    assert token == dashboard_token(job) and token != read_token(job).hex()  # derived, not the job's key
    wrong = token[:-1] + ("1" if token[-1] == "0" else "0")
    with client(job) as web:
        for path in ROUTES:
            assert web.get(path).status_code == 401, path
            assert web.get(path, params={"token": wrong}).status_code == 401, path
            assert web.get(path, headers={"authorization": "Bearer " + token.upper()}).status_code == 401, path
            assert web.get(path, headers={"cookie": f"{cookie_name(8765)}={'x' * 32}"}).status_code == 401, path
            # The cookie of a dashboard on another port is not this one's.
            assert web.get(path, headers={"cookie": f"{cookie_name(8766)}={token}"}).status_code == 401, path
            assert web.post(path, headers={"x-rlplex-action": "1"}).status_code == 401, path
        for path in ("/api/add", "/api/evict", "/api/stop"):
            assert web.post(path, json={}, headers={"x-rlplex-action": "1"}).status_code == 401
        assert web.get("/static/dashboard.js", headers={"authorization": f"Bearer {token}"}).status_code == 200
        assert web.get("/nowhere", headers={"authorization": f"Bearer {token}"}).status_code == 404


def test_the_link_sets_a_cookie_and_drops_the_token_from_the_address(job: Path) -> None:
    token = dashboard_token(job)
    with client(job) as web:
        first = web.get("/", params={"token": token}, follow_redirects=False)
        assert first.status_code == 303 and first.headers["location"] == "/"
        cookie = first.headers["set-cookie"]
        assert (
            cookie.startswith(f"{cookie_name(8765)}={token};") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        )
        # A path that would leave the site ("//host") stays on it.
        assert redirect_of(build_app(ViewSource(job), token), "//evil.example/x", f"token={token}") == "/evil.example/x"
        page = web.get("/")  # the client keeps the cookie
        assert page.status_code == 200 and '<script src="/static/uplot/uPlot.iife.min.js">' in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert page.headers["x-frame-options"] == "DENY" and page.headers["referrer-policy"] == "no-referrer"
        assert "http" not in web.get("/static/dashboard.js").text.replace("https://github.com", "")  # no CDN
        assert web.get("/static/uplot/LICENSE").text.startswith("The MIT License")


def test_the_view_has_the_job_runs_nodes_events_and_sends_only_new_curve_points(job: Path) -> None:
    with client(job) as web:
        web.get("/", params={"token": dashboard_token(job)})
        data = web.get("/api/view").json()
        assert data["kind"] == "main" and data["job"]["state"] == "RUNNING" and data["actions"] is False
        runs = {run["id"]: run for run in data["runs"]}
        assert list(runs) == ["run_00", "run_01", "run_02"]
        first = runs["run_00"]
        assert (first["state"], first["step"], first["max_steps"], first["staleness"]) == ("running", 5, 8, 1.0)
        assert first["curve"] == {"from": 0, "step": [0, 1, 2, 3, 4], "value": [reward(0, s) for s in range(5)]}
        assert first["eval"] == 0.5 and first["eval_curve"] == {"step": [0, 4], "value": [0.25, 0.5]}
        assert first["settings"] == {"max_steps": 8, "seed": 0, "batch_size": 8, "optim.lr": 0.0001}
        assert runs["run_02"]["state"] == "evicted" and runs["run_02"]["reason"] == "bad rollouts: <b>not html</b>"
        assert {(node["role"], node["run"]) for node in data["nodes"]} >= {("orchestrator", "run_01"), ("trainer", "")}
        kinds = [(event["kind"], event["text"]) for event in data["events"]]
        assert ("state", "job: INIT → RUNNING") in kinds and ("eviction", "run_02 evicted") in kinds
        assert ("admission", "run_00 joined") in kinds
        # A new master's takeover is an event of its own kind (tests/control/test_failover.py records real ones).
        store = SqliteStateStore.in_dir(job)
        job_id = store.latest_job_id()
        assert job_id is not None
        store.record_decision(
            job_id, "FAILOVER", "master", "master pid 2 took over from pid 1; 3 of 3 nodes to reattach"
        )
        store.close()
        failover = [event for event in web.get("/api/view").json()["events"] if event["kind"] == "failover"]
        assert [(event["text"], event["cause"][:25]) for event in failover] == [
            ("FAILOVER master", "master pid 2 took over fr")
        ]
        # The page says what it holds; it gets the rest, and a run it holds more of than there is whole.
        append_step(job, 0, "run_00", 5)
        again = {run["id"]: run for run in web.get("/api/view", params={"have": "run_00:5,run_01:99"}).json()["runs"]}
        assert again["run_00"]["curve"] == {"from": 5, "step": [5], "value": [reward(0, 5)]}
        assert again["run_01"]["curve"]["from"] == 0 and len(again["run_01"]["curve"]["step"]) == 5
        assert parse_have("run_a:3,bad,run_b:x,:4,run_c:0") == {"run_a": 3, "run_c": 0}


def test_actions_are_off_unless_allowed_and_go_through_the_cli_functions(
    job: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = {"authorization": f"Bearer {dashboard_token(job)}"}
    with client(job) as web:
        refused = web.post(
            "/api/evict", json={"run": "run_00", "reason": "x"}, headers={**token, "x-rlplex-action": "1"}
        )
        assert refused.status_code == 403 and "--allow-actions" in refused.json()["error"]
    stopped: list[Path] = []
    import rlplex.mainjob.driver as driver

    monkeypatch.setattr(driver, "stop_main_job", lambda folder, console, timeout_s: stopped.append(folder) or "done")
    with client(job, allow_actions=True) as web:
        # A form another site posts cannot set the header: refused before anything is done.
        assert web.post("/api/evict", json={"run": "run_00", "reason": "x"}, headers=token).status_code == 403
        headers = {**token, "x-rlplex-action": "1"}
        answer = web.post("/api/evict", json={"run": "run_00", "reason": "from the page"}, headers=headers)
        assert answer.status_code == 200 and answer.json()["text"] == "run_00: evicted (from the page)"
        assert RunDir(job / "runs", "run_00").eviction_reason() == "from the page"
        again = web.post("/api/evict", json={"run": "run_00", "reason": "twice"}, headers=headers)
        assert again.status_code == 400 and "already evicted (from the page)" in again.json()["error"]
        assert web.post("/api/evict", json={"run": "../x", "reason": "r"}, headers=headers).status_code == 400
        assert web.post("/api/stop", content=b"[1]", headers=headers).status_code == 400
        assert web.post("/api/stop", json={}, headers=headers).status_code == 202
        wait_for(lambda: stopped, 10, "the stop's thread")
        assert stopped == [job]
        messages = lambda: web.get("/api/view", headers=token).json()["messages"]  # noqa: E731
        wait_for(lambda: "stop: done" in messages(), 10, "the stop's message on the page")


def test_a_run_is_added_from_the_page_through_rlplex_runs_adds_function(
    job: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked before anything is asked (one line naming the field and the value), then asked of
    the master through the registry's request files, as `rlplex runs add` asks."""
    token = {"authorization": f"Bearer {dashboard_token(job)}"}
    headers = {**token, "x-rlplex-action": "1"}
    with client(job) as web:
        refused = web.post("/api/add", json={"run": "run_new", "toml": RUN_TOML}, headers=headers)
        assert refused.status_code == 403 and "--allow-actions" in refused.json()["error"]
    with client(job, allow_actions=True) as web:
        add = lambda run, toml: web.post("/api/add", json={"run": run, "toml": toml}, headers=headers)  # noqa: E731
        for run, toml, expected in [
            ("run_new", "max_steps = ", "the page's TOML: not valid TOML"),
            ("run_new", RUN_TOML.replace("max_steps = 2", 'max_steps = "many"'), "field 'max_steps'"),
            ("run_new", "temperatur = 0.5\n" + RUN_TOML, "field 'temperatur'"),
            ("../escape", RUN_TOML, "run id: field 'id'"),
            ("run_00", RUN_TOML, "'run_00' is already in the job"),
            ("run_new", "[trainer]\n[[runs]]\n", "this is a main job, not one run's orchestrator config"),
        ]:
            answer = add(run, toml)
            assert answer.status_code == 400 and expected in answer.json()["error"], (run, toml, answer.json())
        assert "'many'" in add("run_new", RUN_TOML.replace("max_steps = 2", 'max_steps = "many"')).json()["error"]
        assert web.post("/api/add", json={"run": "run_new", "toml": 3}, headers=headers).status_code == 400
        assert not pending_requests(job) and not (job / "requests").exists()  # nothing was asked
        master = Master()
        thread = answer_one_add(job, master)
        answer = add("run_new", RUN_TOML)
        thread.join(10)
        assert answer.status_code == 200, answer.json()
        assert answer.json()["text"] == "add run_new: accepted by the job: run_new added as orchestrator rank 3"
        assert master.scaled == [("orchestrator", 4)]
        added, sent = read_registry(job)[-1], tomllib.loads(RUN_TOML)
        # The TOML crossed as JSON; the master filled in the model's other fields.
        assert added.id == "run_new" and {**added.config, "model": sent["model"]} == sent
        assert added.config["model"]["name"] == "some/model" and added.config["model"]["dtype"] == "auto"
        # The master says no (here: the run's folder is a link to another run's): 400, and said on the page.
        (job / "runs" / "run_link").symlink_to(job / "runs" / "run_00", target_is_directory=True)
        thread = answer_one_add(job, master)
        rejected = add("run_link", RUN_TOML)
        thread.join(10)
        assert rejected.status_code == 400 and "it is a symlink" in rejected.json()["error"]
        messages = web.get("/api/view", headers=token).json()["messages"]
        assert messages[0] == answer.json()["text"] and messages[1].startswith("add run_link: rejected: ")
        assert [entry.id for entry in read_registry(job)][-1] == "run_new"
        monkeypatch.setattr(app_module, "ADD_TIMEOUT_S", 0.3)  # no master answers: said, not hung
        late = add("run_late", RUN_TOML)
        assert late.status_code == 504 and "no answer from the job's master" in late.json()["error"]


def test_a_classic_rl_folder_is_one_run_with_its_return_curve(tmp_path: Path) -> None:
    out = tmp_path / "cartpole"
    out.mkdir()
    (out / "config.json").write_text('{"runner": {"n_steps": 3000}, "algo": {"name": "ppo"}}')
    (out / "progress.csv").write_text(
        "step,charts/online_return_mean,charts/eval_return_mean\n1000,20.5,\n2000,60.0,80.0\n"
    )
    assert folder_kind(out) == "train"
    (run,) = classic_view(out).runs
    assert (run.run_id, run.state, run.trained_steps, run.max_steps) == ("cartpole", "running", 2000, 3000)
    assert run.curve == [(1000.0, 20.5), (2000.0, 60.0)] and run.evaluations == [{"step": 2000.0, "eval/return": 80.0}]
    with client(out) as web:
        token = dashboard_token(out)
        assert token != dashboard_token(out)  # no job token here: a random one per dashboard
        data = TestClient(build_app(ViewSource(out), token)).get(
            "/api/view", headers={"authorization": f"Bearer {token}"}
        )
        assert data.json()["kind"] == "train" and data.json()["runs"][0]["eval"] == 80.0
        assert web.get("/api/view").status_code == 401


def test_rlplex_dashboard_prints_its_link_once_and_listens_on_loopback_only(job: Path, tmp_path: Path) -> None:
    log = tmp_path / "dashboard.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "300"}
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "rlplex.cli", "dashboard", str(job), "--port", "0"], stdout=out, stderr=out, env=env
        )
    try:
        line = wait_for(lambda: "token=" in log.read_text() and log.read_text(), 60, "the dashboard's link")
        assert isinstance(line, str) and line.count("token=") == 1 and "read-only" in line
        url = line.split(": ", 1)[1].strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith(dashboard_token(job))
        listening = [c.laddr for c in psutil.Process(server.pid).net_connections() if c.status == psutil.CONN_LISTEN]
        assert [address.ip for address in listening] == ["127.0.0.1"], listening
        base = url.split("/?")[0]
        assert httpx.get(f"{base}/api/view").status_code == 401
        with httpx.Client() as web:
            assert web.get(url, follow_redirects=True).status_code == 200  # the link, then the cookie
            assert web.get(f"{base}/api/view").json()["runs"][0]["id"] == "run_00"
        server.send_signal(signal.SIGTERM)
        server.wait(scaled(20))
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
    assert log.read_text().count("token=") == 1


def test_progress_rows_are_parsed_once_and_a_rewritten_file_afresh(tmp_path: Path) -> None:
    """The cache behind every collect(): an appended row is added, a half-written one waits, a
    file rewritten under the same name (a new header, fewer rows) is read anew."""
    path = tmp_path / "progress.csv"
    path.write_text("step,reward\n1,0.5\n2,0.25\n")
    first = read_progress_rows(path)
    assert first == [{"step": 1.0, "reward": 0.5}, {"step": 2.0, "reward": 0.25}]
    with open(path, "a") as handle:
        handle.write("3,0.75\n4,0.")  # the last line still being written
    assert read_progress_rows(path) == [*first, {"step": 3.0, "reward": 0.75}]
    assert first[0] is read_progress_rows(path)[0]  # parsed once, not again
    with open(path, "a") as handle:
        handle.write("5\n")
    assert read_progress_rows(path)[-1] == {"step": 4.0, "reward": 0.5}
    path.write_text("step,loss\n7,1.5\n")
    assert read_progress_rows(path) == [{"step": 7.0, "loss": 1.5}]
    path.unlink()
    assert read_progress_rows(path) == []
