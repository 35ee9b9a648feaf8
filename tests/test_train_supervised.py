"""`rlplex train --supervise`: a classic run as a node of a local control-plane job, healed by it.

The real command in a subprocess, a real parallel sampler under the node, a real SIGKILL: the
node and its sampler workers go, the job's failure policy starts the node again, and the run
resumes from its newest snapshot and ends at its n_steps with each logged step once.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from node_helpers import job_processes, node_processes, wait_for
from rlplex.control.job.spec import parse_job
from rlplex.control.job.store import JobStore
from rlplex.diagnostics.metrics import MetricsLogger, read_metrics_csv
from rlplex.errors import JobSpecError
from rlplex.runners.config import load_train_config
from rlplex.runners.train_node import train_job_spec
from timing import scaled

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
RLPLEX = Path(sys.executable).parent / "rlplex"
N_STEPS = 20_480  # ten log intervals of 2,048 steps: a snapshot each


def supervised_config(tmp_path: Path) -> Path:
    """The demo's PPO on a parallel sampler (2 workers), a snapshot every 2,048 steps, no early stop."""
    text = (ROOT / "examples" / "cartpole_ppo.toml").read_text()
    text = text.replace('kind = "serial"', 'kind = "parallel"\nn_workers = 2')
    text = re.sub(r"log_interval_steps = .*", "log_interval_steps = 2048", text)
    text = re.sub(r"stop_at_return = .*", "", text)
    text = re.sub(r"eval_episodes = .*", "eval_episodes = 2", text)
    path = tmp_path / "ppo.toml"
    path.write_text(text)
    return path


def test_sigterm_then_resume_then_a_sigkilled_node_each_step_logged_once_to_the_end(tmp_path: Path) -> None:
    """SIGTERM stops the job (exit 143, nothing left running); the same command with --resume goes
    on from the snapshot; its node is then SIGKILLed with its sampler workers, the job's failure
    policy starts it again from its newest snapshot, and the run ends at n_steps, each step once."""
    out = tmp_path / "out"
    command = [str(RLPLEX), "train", str(supervised_config(tmp_path)), "--supervise", "--output", str(out)]
    snapshots = out / "snapshots"

    def start(*flags: str, log_name: str) -> subprocess.Popen[bytes]:
        with (tmp_path / log_name).open("wb") as log:
            return subprocess.Popen([*command, *flags, "--n-steps", str(N_STEPS)], stdout=log, stderr=subprocess.STDOUT)

    process = start(log_name="first.log")
    try:
        wait_for(lambda: any(snapshots.glob("itr_*/state.json")), 120, "the run's first snapshot")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=scaled(60)) == 128 + signal.SIGTERM
        assert "continue with --resume" in (tmp_path / "first.log").read_text()
        assert psutil.wait_procs(job_processes(out.resolve()), timeout=10)[1] == []  # nothing left running
        stopped_at = int(read_metrics_csv(out / "progress.csv")[-1]["step"])
        assert stopped_at < N_STEPS
        first_snapshots = set(snapshots.glob("itr_*/state.json"))
        process = start("--resume", log_name="resumed.log")
        wait_for(lambda: set(snapshots.glob("itr_*/state.json")) - first_snapshots, 120, "a snapshot after resume")
        (node,) = node_processes(out / "train_job")
        workers = node.children(recursive=True)
        assert len(workers) >= 2, workers  # the parallel sampler's workers are the node's children
        node.send_signal(signal.SIGKILL)
        _, alive = psutil.wait_procs([node, *workers], timeout=30)
        assert not alive, f"the sampler workers outlived their node: {alive}"
        assert process.wait(timeout=scaled(240)) == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for leftover in job_processes(out.resolve()):
            leftover.kill()
    shown = (tmp_path / "resumed.log").read_text()
    assert "--- train-0 incarnation 1" in shown and ": FINISHED" in shown, shown[-3000:]
    store = JobStore.latest(out / "train_job")
    assert store is not None
    (node_row,) = store.nodes()
    assert node_row.progress == {"env_steps": N_STEPS}  # each logged row reached the node's heartbeats
    steps = [int(row["step"]) for row in read_metrics_csv(out / "progress.csv")]
    assert steps == list(range(2048, N_STEPS + 1, 2048)), steps  # on from each snapshot, each step once
    assert (out / "learning_curve.png").exists()


def test_the_train_roles_config_is_validated_when_the_job_loads(tmp_path: Path) -> None:
    spec = train_job_spec(load_train_config(ROOT / "examples" / "cartpole_ppo.toml"), tmp_path)
    data = spec.model_dump(mode="json")
    data["roles"]["train"]["config"]["train"]["algo"]["learning_rate"] = -1.0
    with pytest.raises(JobSpecError, match="learning_rate"):
        parse_job(data, source="a test")


def test_a_resumed_log_drops_the_rows_logged_after_its_snapshot(tmp_path: Path) -> None:
    first = MetricsLogger(tmp_path, tensorboard=False)
    for step in (100, 200, 300):
        first.log(step, {"charts/return": float(step)})
    first.close()
    resumed = MetricsLogger(tmp_path, tensorboard=False, resumed_at=200)  # killed after logging 300
    resumed.log(300, {"charts/return": 301.0})
    assert [(row["step"], row["charts/return"]) for row in read_metrics_csv(tmp_path / "progress.csv")] == [
        (100, 100.0),
        (200, 200.0),
        (300, 301.0),
    ]
