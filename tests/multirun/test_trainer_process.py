"""The trainer as two torchrun-style processes (`python -m rlplex.multirun.trainer` with RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), fed by a fake orchestrator in the test (rollouts generated
by the tiny LM with the run's broadcast adapter), stopped by SIGTERM to one rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from mr_train_helpers import FakeOrchestrator, new_train_run, shared_model
from test_sync_multirank import free_port

from rlplex.multirun.rundir.checkpoint import latest_stable_checkpoint_path
from rlplex.multirun.rundir.peft_export import is_stable_adapter
from rlplex.multirun.trainer.log import read_progress_csv
from timing import scaled

SRC = Path(__file__).resolve().parents[2] / "src"


def start_trainer(output_dir: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    full_env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", **(env or {})}
    command = [sys.executable, "-m", "rlplex.multirun.trainer", "--output-dir", str(output_dir), "--threads", "1"]
    return subprocess.Popen(
        [*command, *args], env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=output_dir
    )


def wait_for(
    condition: Callable[[], bool], procs: list[subprocess.Popen[bytes]], what: str, timeout_s: float = 90
) -> None:
    deadline = time.monotonic() + scaled(timeout_s)
    while not condition():
        for proc in procs:
            if proc.poll() is not None:
                out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
                raise AssertionError(f"trainer exited {proc.returncode} while waiting for {what}:\n{out[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def stop_all(procs: list[subprocess.Popen[bytes]]) -> list[str]:
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=60)[0].decode(errors="replace"))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return logs


STEPS = 8


@pytest.mark.slow
def test_two_torchrun_style_ranks_learn_from_a_fake_orchestrator_and_stop_together(tmp_path: Path) -> None:
    port = str(free_port())
    procs = [
        start_trainer(
            tmp_path,
            "--max-runs",
            "2",
            "--checkpoint-every",
            "5",
            "--model",
            shared_model().name,
            env={"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
        )
        for rank in range(2)
    ]
    try:
        run = new_train_run(tmp_path, "run_learn", max_steps=2 * STEPS, batch_size=32, optim={"lr": 0.02})
        orchestrator = FakeOrchestrator(run, rank=8, alpha=16.0)
        nll, rewards = [], []
        for step in range(STEPS + 1):
            wait_for(lambda s=step: is_stable_adapter(run.broadcast_step(s)), procs, f"broadcast/step_{step}")
            orchestrator.load(step)
            nll.append(orchestrator.target_nll())
            if step < STEPS:
                batch = orchestrator.rollouts(step)
                rewards.append(float(batch.rewards.mean()))
                orchestrator.write(step)
        procs[1].send_signal(signal.SIGTERM)  # one rank told to stop: both must leave together
        logs = stop_all(procs)
    finally:
        stop_all(procs)
    assert [p.returncode for p in procs] == [0, 0], [log[-2000:] for log in logs]
    # The adapters name the model the trainer loaded (and the fake orchestrator samples with).
    adapter_config = json.loads((run.broadcast_step(STEPS) / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == shared_model().name
    # Step 8 is not a checkpoint step (every 5): the trainer checkpoints every run on its way out.
    assert latest_stable_checkpoint_path(run) == run.checkpoint_step(STEPS)
    assert run.checkpoint_step(5).is_dir()
    rows = read_progress_csv(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["total_samples"] == 32 * STEPS
    assert nll[-1] < nll[0] - 0.5, nll  # the rewarded letter became much more likely
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]), rewards
