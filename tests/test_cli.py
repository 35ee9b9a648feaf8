from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CONFIG = """
[env]
id = "{env}"
[sampler]
batch_T = 16
batch_B = 2
[algo]
name = "ppo"
n_epochs = {epochs}
[runner]
kind = "minibatch_eval"
n_steps = 256
log_interval_steps = 64
eval_episodes = 2
"""


def rlplex(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlplex.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.slow
def test_train_writes_curve_metrics_and_snapshot(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(CONFIG.format(env="CartPole-v1", epochs=1))
    done = rlplex("train", str(config), "--output", str(tmp_path / "out"), "--no-progress")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "learning_curve.png").stat().st_size > 1000
    assert (tmp_path / "out" / "progress.csv").exists()
    assert list((tmp_path / "out" / "snapshots").glob("itr_*"))
    resumed = rlplex("train", str(config), "--output", str(tmp_path / "out"), "--resume", "--n-steps", "512")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from" in resumed.stdout


@pytest.mark.slow
def test_user_errors_print_one_line_and_exit_2(tmp_path: Path) -> None:
    bad_value = tmp_path / "bad.toml"
    bad_value.write_text(CONFIG.format(env="CartPole-v1", epochs=0))
    done = rlplex("train", str(bad_value))
    assert done.returncode == 2
    assert "algo.ppo.n_epochs" in done.stdout and "Traceback" not in done.stdout + done.stderr

    bad_env = tmp_path / "env.toml"
    bad_env.write_text(CONFIG.format(env="NoSuchEnv-v9", epochs=1))
    done = rlplex("train", str(bad_env), "--output", str(tmp_path / "o2"))
    assert done.returncode == 2 and "NoSuchEnv-v9" in done.stdout
