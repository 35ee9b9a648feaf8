"""The standalone trainer (`python -m rlplex.multirun.trainer` without torchrun) is a local
control-plane job: its rank is an ElasticWorker under an ElasticMaster, placed, watched and
restarted by the PrimeMaster in the command's process. A SIGKILLed rank is restarted and resumes
from the run's newest broadcast; a SIGKILLed command, run again with the same flags, resumes its
job and re-attaches to the rank that kept training; SIGTERM stops the trainer gracefully through
the control plane (exit 0, a checkpoint of the last step). No step is trained twice."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from mr_train_helpers import new_train_run, shared_model, synthetic_batch

from node_helpers import job_processes, wait_for
from rlplex.control.job.store import STORE_FILE
from rlplex.multirun.rundir import stable_steps
from rlplex.multirun.rundir.checkpoint import latest_stable_checkpoint_path
from rlplex.multirun.rundir.rollouts import write_rollouts
from rlplex.multirun.trainer.job import JOB_FOLDER
from rlplex.multirun.trainer.log import read_progress_csv
from rlplex.multirun.trainer.main import main
from timing import scaled

pytestmark = pytest.mark.e2e

SRC = Path(__file__).resolve().parents[2] / "src"
TIMEOUT_S = scaled(120.0)


def trainer_scripts(job_dir: Path) -> list[psutil.Process]:
    """The rank's script: a child of the trainer node (its command line does not name the folder)."""
    scripts = []
    for node in job_processes(job_dir):
        try:
            if "trainer-0" not in node.cmdline():
                continue
            children = node.children(recursive=True)  # under the node's fork server
            scripts += [c for c in children if "rlplex.multirun.trainer:run_trainer" in " ".join(c.cmdline())]
        except psutil.Error:
            continue
    return scripts


def the_script(job_dir: Path) -> psutil.Process | None:
    scripts = trainer_scripts(job_dir)
    assert len(scripts) <= 1, f"two trainers on one folder: {scripts}"
    return scripts[0] if scripts else None


def start(out: Path, log: Path) -> subprocess.Popen[bytes]:
    model = json.dumps({"name": shared_model().name, "device": "cpu"})
    args = ["--output-dir", str(out), "--max-runs", "1", "--model-json", model, "--checkpoint-every", "1"]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None)
    with log.open("ab") as handle:  # a file, not a pipe: a full pipe would block the command
        return subprocess.Popen(
            [sys.executable, "-m", "rlplex.multirun.trainer", *args, "--threads", "1"],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )


def resumed(command: subprocess.Popen[bytes], log: Path) -> bool:
    text = log.read_text()
    if command.poll() is not None:
        raise AssertionError(f"the trainer exited {command.returncode}:\n{text[-4000:]}")
    return "resuming the unfinished trainer job" in text


def test_a_killed_rank_and_a_killed_command_lose_no_step_and_sigterm_stops_gracefully(tmp_path: Path) -> None:
    out, log = tmp_path / "runs", tmp_path / "trainer.log"
    out.mkdir()
    job_dir = out / JOB_FOLDER
    run = new_train_run(out, "run_a", max_steps=20, optim={"lr": 0.01})
    command = start(out, log)

    def feed_until(step: int) -> None:
        """Rollouts for each step up to `step`, each written after the trainer broadcast the
        policy it is for (as an orchestrator does), then wait for `step`'s broadcast."""
        for k in range(step):
            if not run.rollout_step(k).exists():
                broadcast(k)
                write_rollouts(run, synthetic_batch("run_a", k, seed=1))
        broadcast(step)

    def broadcast(step: int) -> None:
        def done() -> bool:
            if command.poll() is not None:
                raise AssertionError(f"the trainer exited {command.returncode}:\n{log.read_text()[-4000:]}")
            return step in {s for s, _ in stable_steps(run.broadcast)}

        wait_for(done, TIMEOUT_S, f"broadcast/step_{step}")

    try:
        feed_until(2)
        first = wait_for(lambda: the_script(job_dir), 30, "the rank's script")
        first.send_signal(signal.SIGKILL)
        feed_until(4)
        second = wait_for(lambda: the_script(job_dir), 30, "the restarted rank's script")
        assert second.pid != first.pid
        # The command dies; its job's nodes carry on. The same command again resumes that job.
        command.send_signal(signal.SIGKILL)
        command.wait(10)
        command = start(out, log)
        wait_for(lambda: resumed(command, log), TIMEOUT_S, "the job resumed")
        feed_until(6)
        assert the_script(job_dir) is not None and the_script(job_dir).pid == second.pid  # re-attached, not restarted
        command.send_signal(signal.SIGTERM)
        assert command.wait(timeout=TIMEOUT_S) == 0, log.read_text()[-4000:]
    finally:
        if command.poll() is None:
            command.kill()
            command.wait(10)
        _gone, alive = psutil.wait_procs(job_processes(job_dir), timeout=10.0)
        for process in alive:
            process.kill()
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"
    text = log.read_text()
    assert ": FINISHED" in text, text[-3000:]  # its ranks stopped gracefully: the service ended its work
    with sqlite3.connect(job_dir / STORE_FILE) as db:
        assert db.execute("SELECT count(*) FROM jobs").fetchone() == (1,)  # resumed, not a second job
    # The graceful stop checkpointed the last trained step; no step was trained twice.
    steps = [r["step"] for r in read_progress_csv(run)]
    assert steps == list(range(1, 7)), steps
    assert latest_stable_checkpoint_path(run) == run.checkpoint_step(6)


def test_other_flags_on_an_unfinished_job_are_refused_naming_how_to_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job whose command was killed may still run its ranks: a trainer with other settings on the
    same folder would be a second trainer on the same runs."""
    from rlplex.control.job.local_run import open_master
    from rlplex.multirun.trainer.config import TrainerConfig
    from rlplex.multirun.trainer.job import trainer_job_spec

    config = TrainerConfig(output_dir=tmp_path, max_runs=1, model=shared_model())
    open_master(trainer_job_spec(config)).close()  # its master gone before the job ended
    model = json.dumps(shared_model().model_dump(mode="json"))
    assert main(["--output-dir", str(tmp_path), "--max-runs", "2", "--model-json", model]) == 2
    error = capsys.readouterr().err
    assert "unfinished trainer job with other settings" in error and str(tmp_path / JOB_FOLDER) in error, error
    assert f"rlplex job resume {tmp_path / JOB_FOLDER}" in error
