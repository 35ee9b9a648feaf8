"""The dashboard's first paint and live-update latency on a job of 16 runs x 1,000 steps.

    python -m benchmarks.dashboard_latency [--runs 16] [--steps 1000] [--updates 10]

A synthetic main-job folder (the files a real job writes: job.sqlite, runs.json, each run's
broadcasts, progress.csv and trainer_progress.csv) is served by `rlplex dashboard`'s server on
a thread; headless Chromium (Debian's, driven by Playwright) opens the link. Measured:

- first paint: from the navigation's start to the page's first drawn view (runs table and
  curves), as the page itself stamps it (`performance.now()`);
- live update: from a step's row being appended to its run's progress.csv to the page holding
  that point (polled in the page every 10 ms);
- /api/view: server time of a first (whole) answer and of an incremental one;
- a master's cost per open page and poll (`[dashboard] enabled`): the JSON of the view its
  loop read anyway, with one new point per run;
- collect(): one reading of the folder, the first (cold) and a later one.

Goals (issue 34): first paint <= 1 s, live update <= 2 s. Without a browser it measures the
server side only and says so. Writes bench_results/dashboard_latency.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from rlplex.control.job.store import SqliteStateStore
from rlplex.control.job.token import write_token
from rlplex.dashboard.config import DashboardConfig
from rlplex.dashboard.server import DashboardServer
from rlplex.dashboard.snapshot import snapshot
from rlplex.dashboard.sources import EVENTS
from rlplex.mainjob.config import RunEntry
from rlplex.mainjob.progress_rows import clear_cache
from rlplex.mainjob.registry import write_registry
from rlplex.mainjob.view import collect
from rlplex.multirun.rundir import STABLE_MARKER, RunDir

CHROMIUM = Path(os.environ.get("RLPLEX_CHROMIUM", "/usr/bin/chromium"))
PROGRESS_HEADER = "step,charts/reward_mean,charts/tokens_per_s,charts/policy_lag,charts/policy_step\n"


def progress_line(run: int, step: int) -> str:
    return f"{step},{0.5 + step / 4000 + 0.01 * (run % 5):.4f},1234.5,1,{step}\n"


def make_job(out: Path, runs: int, steps: int, max_steps: int | None = None) -> list[str]:
    """A main job's folder as a running job leaves it: `runs` runs with `steps` steps each."""
    out.mkdir(parents=True)
    write_token(out)
    store = SqliteStateStore.in_dir(out)
    store.create_job("mj-bench", "bench", "{}")
    store.record_transition("mj-bench", "job", "INIT", "RUNNING", "started")
    started = time.time() - 3 * steps
    ids, entries = [], []
    for i in range(runs):
        run_id = f"run_{i:02d}"
        ids.append(run_id)
        entries.append(RunEntry(id=run_id, config={"max_steps": max_steps or 2 * steps, "seed": i, "batch_size": 8,
                                                   "optim": {"lr": 1e-4 * (i + 1)}}))  # fmt: skip
        store.add_node("mj-bench", f"orchestrator-{i}", "orchestrator", i, "RUNNING")
        run = RunDir(out / "runs", run_id)
        run.control.mkdir(parents=True)
        run.ensure_identity()
        stable = run.broadcast_step(steps)
        stable.mkdir(parents=True)
        (stable / STABLE_MARKER).write_text("")
        (run.root / "progress.csv").write_text(PROGRESS_HEADER + "".join(progress_line(i, s) for s in range(steps)))
        (run.root / "logs").mkdir()
        (run.root / "logs" / "trainer_progress.csv").write_text(
            "step,time,total_tokens,loss\n"
            + "".join(f"{s},{started + 3 * s},{1000 * s},0.1\n" for s in range(1, steps))
        )
    store.add_node("mj-bench", "trainer-0", "trainer", 0, "RUNNING")
    store.close()
    write_registry(out, entries)
    return ids


def append_step(out: Path, run_index: int, run_id: str, step: int) -> None:
    with open(out / "runs" / run_id / "progress.csv", "a") as handle:
        handle.write(progress_line(run_index, step))


def server_side(out: Path, server: DashboardServer) -> dict[str, float]:
    token = server.url.split("token=")[1]
    base = server.url.split("/?")[0]
    headers = {"authorization": f"Bearer {token}"}
    clear_cache()
    cold = time.perf_counter()
    collect(out)
    cold_s = time.perf_counter() - cold
    warm = time.perf_counter()
    collect(out)
    warm_s = time.perf_counter() - warm
    # A master serving the page pays, per open page and poll, for the JSON of a view its own
    # loop has read already: the new points of each run (`have`: it holds the rest).
    view = collect(out, events=EVENTS)
    newest = {run.run_id: len(run.curve) - 1 for run in view.runs}
    started = time.perf_counter()
    for _ in range(20):
        json.dumps(snapshot(view, "main", newest, False), allow_nan=False)
    per_poll_s = (time.perf_counter() - started) / 20
    with httpx.Client(base_url=base, headers=headers) as client:
        started = time.perf_counter()
        whole = client.get("/api/view")
        whole_s = time.perf_counter() - started
        have = ",".join(f"{run['id']}:{len(run['curve']['step'])}" for run in whole.json()["runs"])
        time.sleep(server.source.min_interval_s)  # past the shared view's interval: a fresh read
        started = time.perf_counter()
        client.get("/api/view", params={"have": have})
        incremental_s = time.perf_counter() - started
    return {
        "master_per_poll_s": per_poll_s,
        "collect_cold_s": cold_s,
        "collect_s": warm_s,
        "api_whole_s": whole_s,
        "api_whole_kb": len(whole.content) / 1024,
        "api_incremental_s": incremental_s,
    }


def in_browser(out: Path, server: DashboardServer, ids: list[str], steps: int, updates: int) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            # Playwright's waits evaluate strings, which the page's CSP forbids its own scripts.
            page = browser.new_page(viewport={"width": 1400, "height": 900}, bypass_csp=True)
            page.goto(server.url)
            page.wait_for_function("document.body.dataset.firstPaintMs !== undefined", timeout=30_000)
            first_paint_ms = float(page.evaluate("document.body.dataset.firstPaintMs"))
            latencies = []
            for n in range(updates):
                index = n % len(ids)
                held = int(page.get_attribute(f'tr[data-run="{ids[index]}"]', "data-points") or 0)
                appended = time.perf_counter()
                append_step(out, index, ids[index], steps + n)
                page.wait_for_function(
                    f"Number(document.querySelector('tr[data-run=\"{ids[index]}\"]').dataset.points) > {held}",
                    polling=10,
                    timeout=10_000,
                )
                latencies.append(time.perf_counter() - appended)
        finally:
            browser.close()
    return {"first_paint_s": first_paint_ms / 1000, "update_median_s": statistics.median(latencies),
            "update_max_s": max(latencies)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--updates", type=int, default=10)
    args = parser.parse_args()
    from benchmarks.common import report  # numpy, rich and the runners: not for the tests' make_job

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "job"
        ids = make_job(out, args.runs, args.steps)
        server = DashboardServer.create(out, DashboardConfig())
        server.start()
        try:
            browser, figures = "none", {}
            if CHROMIUM.exists():  # first: the page's first view reads the folder cold
                with contextlib.suppress(ImportError):
                    figures = in_browser(out, server, ids, args.steps, args.updates)
                    browser = str(CHROMIUM)
            figures |= server_side(out, server)
        finally:
            server.close()
    title = f"dashboard: {args.runs} runs x {args.steps} steps (browser: {browser})"
    rows = [[name, value] for name, value in figures.items()]
    report("dashboard_latency", title, ["figure", "value"], rows, {"runs": args.runs, "steps": args.steps,
                                                                   "browser": browser, **figures})  # fmt: skip


if __name__ == "__main__":
    main()
