"""The main job end to end with a tiny budget: every process real (PrimeMaster, elastic trainer
ranks over gloo, orchestrators, conductor); a run added and a run evicted by the job's events."""

from __future__ import annotations

from pathlib import Path

import psutil
from mainjob_helpers import run_config, tiny_job
from rich.console import Console

from node_helpers import job_processes
from rlplex.control.states import JobState
from rlplex.mainjob.config import load_main_job
from rlplex.mainjob.driver import run_main_job
from rlplex.mainjob.view import collect

EVENTS = """
[[events]]
when = { run = "run_a", step = 1 }
add_run = "run_c"
[[events]]
when = { run = "run_b", step = 1 }
evict_run = "run_b"
reason = "evicted on purpose by the test"
"""


def test_main_job_runs_end_to_end_with_an_added_and_an_evicted_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    path = tmp_path / "job.toml"
    runs = {"run_a": run_config(1, 3), "run_b": run_config(2, 30, "optim = { lr = 3e-3 }")}
    path.write_text(tiny_job("mj-e2e", out, runs, {"run_c": run_config(3, 2)}, rest=EVENTS))
    try:
        state = run_main_job(load_main_job(path), Console(file=open(tmp_path / "console.txt", "w")), live=False)
        assert state == JobState.STOPPED, (out / "report.md").read_text()
        runs = {run.run_id: run for run in collect(out).runs}
        assert set(runs) == {"run_a", "run_b", "run_c"}
        assert runs["run_a"].state == runs["run_c"].state == "finished"
        assert runs["run_a"].trained_steps == 3 and runs["run_c"].trained_steps == 2
        assert runs["run_b"].state == "evicted" and runs["run_b"].reason == "evicted on purpose by the test"
        assert runs["run_b"].trained_steps < 30  # the others carried on without it
        report = (out / "report.md").read_text()
        for section in ("## Runs", "## Learning curves", "## Nodes and restarts", "## Evictions", "tokens/s"):
            assert section in report, section
        for png in ("rewards.png", "run_a.png", "run_c.png"):
            assert (out / "plots" / png).stat().st_size > 1000
        assert list((out / "tb" / "run_a").glob("events.out.tfevents.*"))
    finally:
        _gone, alive = psutil.wait_procs(job_processes(out), timeout=10.0)
        for process in alive:
            process.kill()
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"
