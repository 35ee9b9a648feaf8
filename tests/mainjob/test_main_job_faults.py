"""The main job is stopped by SIGTERM and continued (`rlplex run --continue`), then survives
SIGKILL of one orchestrator (watched on the job's dashboard in a browser), one rollout node, one
trainer rank and then of `rlplex run` itself (resumed with `rlplex resume`): the job still
finishes, every run trains all its steps, and no step is trained twice (each run's final
checkpoint counts exactly max_steps x batch_size samples, and the trainer's log holds each step
once), with `checkpoint_every = 10`: the killed trainer resumes from its newest broadcast, not
from a checkpoint steps behind it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from dashboard_browser import open_dashboard
from mainjob_helpers import BATCH, run_config, tiny_job

from node_helpers import job_processes, listening_sockets, wait_for
from rlplex.control.elastic.master import read_elastic_status
from rlplex.mainjob.view import collect, read_progress_rows
from rlplex.multirun.rundir import RunDir, stable_steps
from timing import scaled

pytestmark = pytest.mark.e2e

STEPS = 30  # enough that the faults land while both runs still train (a step can take 0.1 s)


def node_process(out: Path, node_id: str) -> psutil.Process | None:
    for process in job_processes(out):
        cmdline = process.info["cmdline"] or []
        if "rlplex.control.node.runtime" in cmdline and node_id in cmdline:
            return process
    return None


def trainer_script(out: Path, rank_node: str) -> psutil.Process | None:
    node = node_process(out, rank_node)
    if node is None:
        return None
    try:
        children = node.children(recursive=True)  # under the node's fork server
    except psutil.NoSuchProcess:
        return None
    scripts = [child for child in children if "rlplex.multirun.trainer" in " ".join(child.cmdline())]
    return scripts[0] if scripts else None


def job_story(tmp_path: Path, out: Path) -> str:
    """What a failure message needs: the CLI's log, the report and the master's log."""
    parts = []
    for path, tail in ((tmp_path / "job.log", 3000), (out / "report.md", 4000), (out / "master.log", 6000)):
        with contextlib.suppress(OSError):
            parts.append(f"--- {path.name}:\n{path.read_text()[-tail:]}")
    return "\n".join(parts)


def restarts(out: Path, role: str, rank: int) -> int:
    return next((node.restarts for node in collect(out).nodes if (node.role, node.rank) == (role, rank)), 0)


def elastic_restarts(out: Path) -> int:
    return int(read_elastic_status(out, "elastic-0").get("restarts", 0))


def trained(out: Path, run_id: str) -> int:
    return next((run.trained_steps for run in collect(out).runs if run.run_id == run_id), 0)


def test_signals_and_sigkills_of_every_process_lose_and_repeat_no_step(tmp_path: Path) -> None:
    """SIGTERM stops `rlplex run` cleanly (report written, no process left); `rlplex run
    --continue` carries on. Then SIGKILL of an orchestrator, a rollout node,
    trainer rank 0 and the master, and `rlplex resume` to the end: every run trains all its steps,
    none twice."""
    out = tmp_path / "out"
    path = tmp_path / "job.toml"
    log_path = tmp_path / "job.log"
    # run_b generates on two nodes of the job's rollout role, run_a in its orchestrator.
    runs = {"run_a": run_config(1, STEPS), "run_b": run_config(2, STEPS, "rollout_workers = 2")}
    path.write_text(tiny_job("mj-faults", out, runs, trainer="checkpoint_every = 10"))
    log = open(log_path, "a")
    command = [sys.executable, "-m", "rlplex.cli"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def start(*args: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([*command, *args, "--no-live"], stdout=log, stderr=subprocess.STDOUT, env=env)

    out.mkdir()
    # The job's dashboard in a browser (its JSON where none can run), open from before the job
    # starts until its SIGKILLed orchestrator's restart shows, through the SIGTERM and the
    # `--continue`, never reloaded: the runs appear, the curves gain points, the restart shows;
    # a request without the token is refused (open_dashboard).
    dashboard_open = contextlib.ExitStack()
    dashboard = dashboard_open.enter_context(open_dashboard(out, tmp_path / "dashboard.log"))
    job = start("run", str(path))

    def trained_while_running(run_id: str, steps: int) -> bool:
        if job.poll() is not None:
            raise AssertionError(f"the job ended early:\n{job_story(tmp_path, out)}")
        return trained(out, run_id) >= steps

    def stopped_cleanly_by(signum: int) -> None:
        (out / "report.md").unlink(missing_ok=True)
        job.send_signal(signum)
        assert job.wait(timeout=scaled(120)) == 128 + signum, job_story(tmp_path, out)
        assert collect(out).job_state == "STOPPED"
        said = f"STOPPED by {signal.Signals(signum).name}"  # not FINISHED: a stop is no success (issue 32, hole 6)
        assert f"Job state: **{said}**" in (out / "report.md").read_text()
        assert log_path.read_text().count(said) == 1, job_story(tmp_path, out)  # said once, as the last line
        # The stop's promise (README): every run is checkpointed at the step it trained last.
        for run in collect(out).runs:
            names = [p.name.removeprefix("step_") for p in RunDir(out / "runs", run.run_id).checkpoints.glob("step_*")]
            newest = max((int(n) for n in names if n.isdigit()), default=0)
            assert newest == run.trained_steps, (run.run_id, sorted(names), run.trained_steps)
        _gone, alive = psutil.wait_procs(job_processes(out), timeout=10.0)
        assert not alive, f"processes left behind: {[p.pid for p in alive]}"

    try:
        # Signals first, while the runs have most of their steps ahead.
        wait_for(lambda: trained_while_running("run_a", 1), 240, "run_a's first trained step")
        dashboard.wait("both runs", lambda rows: {"run_a", "run_b"} <= set(rows), 30)
        stopped_cleanly_by(signal.SIGTERM)
        held = sum(int(row["points"]) for row in dashboard.wait("the stopped job", lambda rows: rows, 10).values())
        assert "rlplex resume" in log_path.read_text()
        # SIGHUP and SIGINT take the same path as SIGTERM: tests/mainjob/test_stop_signals.py.
        # `rlplex resume` of a stopped job: tests/test_readme_commands.py::test_main_job_commands.
        job = start("run", str(path), "--continue")
        next_step = trained(out, "run_a") + 1
        wait_for(lambda: trained_while_running("run_a", next_step), 240, "run_a's next step after --continue")
        dashboard.wait("new curve points", lambda rows: sum(int(r["points"]) for r in rows.values()) > held, 30)
        assert trained(out, "run_a") < STEPS and trained(out, "run_b") < STEPS, "too few steps left for the faults"
        # Every port of the running main job (master, trainer ranks and their rank-0 store, gloo,
        # orchestrators, conductor) is on loopback: issue 18's socket check.
        master = psutil.Process(job.pid)
        processes = {p.pid: p for p in [master, *master.children(recursive=True), *job_processes(out)]}
        for process in list(processes.values()):
            with contextlib.suppress(psutil.Error):
                processes.update({c.pid: c for c in process.children(recursive=True)})
        found = listening_sockets(list(processes.values()))
        assert len(found) >= 3, found  # at least the master's listener and two nodes' RPC
        assert [f for f in found if f[1] not in ("127.0.0.1", "::1")] == []
        orchestrator = wait_for(lambda: node_process(out, "orchestrator-0"), 30, "orchestrator-0's process")
        assert isinstance(orchestrator, psutil.Process)
        orchestrator.send_signal(signal.SIGKILL)
        # Each fault is taken in turn: the master restarts the orchestrator before the next.
        wait_for(lambda: restarts(out, "orchestrator", 0) >= 1, 60, "orchestrator-0's restart")
        dashboard.wait("run_a's restart", lambda rows: int(rows["run_a"]["restarts"]) >= 1, 30)
        dashboard_open.close()  # the faults below need the cores more than a browser
        # A rollout node dies under run_b's orchestrator (the master starts its next incarnation and
        # the orchestrator issues its call there again) and trainer rank 0 with it (rank 0 writes the
        # checkpoints: SIGKILLed, it has no chance to checkpoint on the way out; the ranks
        # re-rendezvous). Both at once: one after the other, a loaded machine's waits for the first
        # restart let run_b train its last steps before the second fault landed.
        rollout = wait_for(lambda: node_process(out, "rollout-0"), 30, "rollout-0's process")
        rank_0 = wait_for(lambda: trainer_script(out, "trainer-0"), 60, "trainer rank 0's script")
        assert isinstance(rollout, psutil.Process) and isinstance(rank_0, psutil.Process)
        assert trained_while_running("run_b", 0) and trained(out, "run_b") < STEPS, "too few steps left for the faults"
        rollout.send_signal(signal.SIGKILL)
        rank_0.send_signal(signal.SIGKILL)
        wait_for(lambda: restarts(out, "rollout", 0) >= 1, 120, "rollout-0's restart")
        wait_for(lambda: elastic_restarts(out) >= 1, 120, "the trainer ranks' re-rendezvous")
        next_step = trained(out, "run_b") + 1
        wait_for(lambda: trained_while_running("run_b", next_step), 180, "run_b's next trained step")
        job.send_signal(signal.SIGKILL)  # the master dies; its nodes carry on without it
        job.wait(10)
        job = start("resume", str(out))
        assert job.wait(timeout=scaled(360)) == 0, job_story(tmp_path, out)
        assert log_path.read_text().rstrip().splitlines()[-1].startswith("job FINISHED; report: ")
        view = collect(out)
        assert restarts(out, "orchestrator", 0) >= 1 and restarts(out, "rollout", 0) >= 1
        assert elastic_restarts(out) >= 1  # the trainer ranks re-rendezvoused
        # The view shows them (a busy machine may add a re-rendezvous of its own: any count >= 1).
        assert any(re.search(r"restarts [1-9]", line) for line in view.rendezvous), view.rendezvous
        for run in view.runs:
            assert (run.state, run.trained_steps) == ("finished", STEPS), run
            run_dir = RunDir(out / "runs", run.run_id)
            final = run_dir.checkpoints / f"step_{STEPS}"
            progress = json.loads((final / "progress.json").read_text())
            assert progress["total_samples"] == STEPS * BATCH, progress  # no step counted twice
            assert [step for step, _ in stable_steps(run_dir.broadcast)][-1] == STEPS
            logged = [int(row["step"]) for row in read_progress_rows(run_dir.root / "logs" / "trainer_progress.csv")]
            assert len(logged) == len(set(logged)), f"{run.run_id} trained a step twice: {logged}"
    finally:
        dashboard_open.close()
        if job.poll() is None:
            job.kill()
            job.wait(10)
        log.close()
        _gone, alive = psutil.wait_procs(job_processes(out), timeout=10.0)
        for process in alive:
            process.kill()
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"
