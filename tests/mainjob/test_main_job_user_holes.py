"""Issue 18, the main job as a user meets it: a run the trainer rejects ends alone (the job goes
on), what the files already show is refused before anything starts, and a job stopped by a
signal or by `rlplex stop` writes its report, leaves no process and continues later from its
checkpoints without training any step twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
from mainjob_helpers import BATCH, run_config, tiny_job
from rich.console import Console

from node_helpers import job_processes, wait_for
from rlplex.config import load_config
from rlplex.control.job.states import JobState
from rlplex.mainjob.config import MainJobConfig
from rlplex.mainjob.driver import run_main_job
from rlplex.mainjob.view import collect, read_progress_rows
from rlplex.multirun.rundir import RunDir, stable_steps

COMMAND = [sys.executable, "-m", "rlplex.cli"]


def reap(out: Path) -> list[psutil.Process]:
    """Kill what a failed test left of the job; return what was still alive."""
    _gone, alive = psutil.wait_procs(job_processes(out), timeout=10.0)
    for process in alive:
        process.kill()
    return alive


def test_a_run_the_trainer_rejects_ends_alone_and_is_never_restarted(tmp_path: Path) -> None:
    out = tmp_path / "out"
    path = tmp_path / "job.toml"
    runs = {"run_ok": run_config(1, 2), "run_wide": run_config(2, 2, "model = { lora = { rank = 16 } }")}
    path.write_text(tiny_job("mj-reject", out, runs))
    console = Console(file=open(tmp_path / "console.txt", "w"))
    try:
        # Without the preflight: the trainer itself judges the run when it discovers it.
        state = run_main_job(load_config(MainJobConfig, path), console, live=False, check_runs=False)
        assert state == JobState.STOPPED, (out / "report.md").read_text()
        runs_now = {run.run_id: run for run in collect(out).runs}
        assert (runs_now["run_ok"].state, runs_now["run_ok"].trained_steps) == ("finished", 2)
        assert runs_now["run_wide"].state == "rejected"
        assert "model.lora.rank" in runs_now["run_wide"].reason and "16" in runs_now["run_wide"].reason
        orchestrators = {node.rank: node for node in collect(out).nodes if node.role == "orchestrator"}
        assert orchestrators[1].restarts == 0, orchestrators[1]
        assert "rejected" in (out / "report.md").read_text()
    finally:
        alive = reap(out)
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"


def test_rlplex_run_reports_every_problem_the_files_show_before_anything_starts(tmp_path: Path) -> None:
    from lm_models import random_llama

    out = tmp_path / "out"
    path = tmp_path / "job.toml"
    runs = {
        "run_wide": run_config(1, 2, "model = { lora = { rank = 16 } }"),
        "run_other": run_config(2, 2, f'model = {{ name = "{random_llama()}" }}'),
        "run_huge": run_config(3, 2).replace(f"batch_size = {BATCH}", "batch_size = 4000000000"),
    }
    path.write_text(
        tiny_job("mj-preflight", out, runs, trainer="max_lora_rank = 8").replace("max_runs = 4", "max_runs = 100000000")
    )
    done = subprocess.run([*COMMAND, "run", str(path), "--no-live"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    errors = [line for line in done.stdout.splitlines() if line.startswith("error:")]
    expected = {
        "run_wide": "model.lora.rank",
        "run_other": "model.name",
        "run_huge": "batch_size",
        "trainer.max_runs": "adapter slots",
    }
    for key, field in expected.items():
        assert any(key in line and field in line for line in errors), (key, done.stdout)
    assert len(errors) == len(expected), done.stdout
    assert not (out / "job.sqlite").exists()  # nothing was started


def progress_of(out: Path, run_id: str) -> int:
    return next((run.trained_steps for run in collect(out).runs if run.run_id == run_id), 0)


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "a") as sink:
        return subprocess.Popen([*COMMAND, *args], stdout=sink, stderr=subprocess.STDOUT, env=env)


def test_signals_and_rlplex_stop_end_the_job_cleanly_and_it_continues_to_the_end(tmp_path: Path) -> None:
    """SIGTERM, then SIGHUP, then `rlplex stop`: each writes the report and leaves no process;
    `rlplex resume` and `rlplex run --continue` carry on, and no step is trained twice."""
    steps = 6
    out = tmp_path / "out"
    path = tmp_path / "job.toml"
    log = tmp_path / "job.log"
    path.write_text(tiny_job("mj-stop", out, {"run_a": run_config(1, steps), "run_b": run_config(2, 2)}))
    job: subprocess.Popen[bytes] | None = None

    def until_trained(steps_wanted: int) -> None:
        def ready() -> bool:
            if job is not None and job.poll() is not None:
                raise AssertionError(f"the job ended early:\n{log.read_text()[-3000:]}")
            return progress_of(out, "run_a") >= steps_wanted

        wait_for(ready, 300, f"run_a's step {steps_wanted}", interval=0.2)

    def stopped_cleanly(code: int) -> None:
        assert job is not None
        assert job.wait(timeout=120) == code, log.read_text()[-3000:]
        assert collect(out).job_state == "STOPPED"
        assert "Job state: **STOPPED**" in (out / "report.md").read_text()
        assert not reap(out), "processes left behind"

    try:
        job = start(["run", str(path), "--no-live"], log)
        until_trained(1)
        (out / "report.md").unlink(missing_ok=True)
        job.send_signal(signal.SIGTERM)
        stopped_cleanly(128 + signal.SIGTERM)
        assert "rlplex resume" in log.read_text()
        first_stop = progress_of(out, "run_a")
        assert first_stop < steps

        job = start(["resume", str(out), "--no-live"], log)
        until_trained(first_stop + 1)
        (out / "report.md").unlink()
        job.send_signal(signal.SIGHUP)
        stopped_cleanly(128 + signal.SIGHUP)

        job = start(["run", str(path), "--continue", "--no-live"], log)
        if progress_of(out, "run_a") < steps - 1:
            until_trained(progress_of(out, "run_a") + 1)
            (out / "report.md").unlink()
            stop = subprocess.run([*COMMAND, "stop", str(out)], capture_output=True, text=True, timeout=200)
            assert stop.returncode == 0, stop.stdout + stop.stderr
            stopped_cleanly(0)
            # The stop may land as the job ends by itself: continue only what is left.
            if any(run.state != "finished" for run in collect(out).runs):
                job = start(["resume", str(out), "--no-live"], log)
        assert job.wait(timeout=400) == 0, log.read_text()[-3000:]
        job = None
        view = collect(out)
        assert view.job_state == "STOPPED"
        for run in view.runs:
            wanted = steps if run.run_id == "run_a" else 2
            assert (run.state, run.trained_steps) == ("finished", wanted), run
            run_dir = RunDir(out / "runs", run.run_id)
            progress = json.loads((run_dir.checkpoints / f"step_{wanted}" / "progress.json").read_text())
            assert progress["total_samples"] == wanted * BATCH, progress  # no step counted twice
            assert [step for step, _ in stable_steps(run_dir.broadcast)][-1] == wanted
            logged = [int(row["step"]) for row in read_progress_rows(run_dir.root / "logs" / "trainer_progress.csv")]
            assert len(logged) == len(set(logged)), f"{run.run_id} trained a step twice: {logged}"
    finally:
        if job is not None and job.poll() is None:
            job.kill()
            job.wait(10)
        alive = reap(out)
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"
