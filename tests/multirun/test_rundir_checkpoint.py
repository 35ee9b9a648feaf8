from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
import torch
from mr_helpers import new_run

from rlplex.errors import CheckpointError, MultiRunError, RunDirGoneError
from rlplex.multirun import STABLE_MARKER, RunDir, RunProgress, load_checkpoint
from rlplex.multirun.rundir import checkpoint as checkpoint_module
from rlplex.multirun.rundir.checkpoint import latest_stable_checkpoint_path, save_checkpoint


def state(value: float) -> tuple[dict, dict, dict]:
    adapter = {"layer.lora_A.weight": torch.full((2, 3), value)}
    optimizer = {"state": {0: {"exp_avg": torch.full((2, 3), value)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    return adapter, optimizer, {"last_epoch": int(value)}


def test_layout_matches_the_seed(tmp_path: Path) -> None:
    run = RunDir(tmp_path, "run_abc123")
    assert run.orch_config == tmp_path / "run_abc123/control/orch.toml"
    assert run.config_error == tmp_path / "run_abc123/control/config_validation_error.txt"
    assert run.evicted == tmp_path / "run_abc123/control/evicted.txt"
    assert run.checkpoint_step(100) == tmp_path / "run_abc123/checkpoints/step_100"
    assert run.rollout_step(100) == tmp_path / "run_abc123/rollouts/step_100"
    assert run.broadcast_step(100) == tmp_path / "run_abc123/broadcast/step_100"


@pytest.mark.parametrize("name", ["run_", "run_..", "run_a/../../x", "xrun_a", "run_a..b", "run_\n", "run_a\n"])
def test_unsafe_run_ids_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(MultiRunError, match="not a valid run id"):
        RunDir(tmp_path, name)


def test_write_never_recreates_a_deleted_run(tmp_path: Path) -> None:
    run = new_run(tmp_path, "run_a")
    shutil.rmtree(run.root)
    with pytest.raises(RunDirGoneError):
        run.write_text(run.evicted, "late")
    with pytest.raises(RunDirGoneError):
        save_checkpoint(run, 1, *state(1.0), RunProgress())
    assert not run.root.exists()


def test_write_refuses_a_symlinked_control_dir(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    run = RunDir(tmp_path / "out", "run_a")
    run.root.mkdir(parents=True)
    run.control.symlink_to(outside)
    with pytest.raises(MultiRunError, match="symlink"):
        run.write_text(run.evicted, "x")
    assert list(outside.iterdir()) == []


def test_checkpoint_round_trip_with_progress_and_stable_marker(tmp_path: Path) -> None:
    run = new_run(tmp_path, "run_a")
    path = save_checkpoint(run, 5, *state(2.0), RunProgress(step=5, total_tokens=640, total_samples=20))
    assert path == run.checkpoint_step(5)
    assert (path / STABLE_MARKER).exists()
    loaded = load_checkpoint(path)
    assert loaded.step == 5
    assert torch.equal(loaded.adapter["layer.lora_A.weight"], torch.full((2, 3), 2.0))
    assert torch.equal(loaded.optimizer["state"][0]["exp_avg"], torch.full((2, 3), 2.0))
    assert loaded.scheduler == {"last_epoch": 2}
    assert loaded.progress == RunProgress(step=5, total_tokens=640, total_samples=20)
    assert [p.name for p in run.checkpoints.iterdir()] == ["step_5"]  # no temporaries left


def test_latest_stable_skips_unmarked_steps(tmp_path: Path) -> None:
    run = new_run(tmp_path, "run_a")
    save_checkpoint(run, 1, *state(1.0), RunProgress(step=1))
    save_checkpoint(run, 2, *state(2.0), RunProgress(step=2))
    (run.checkpoint_step(2) / STABLE_MARKER).unlink()
    run.checkpoint_step(3).mkdir()
    assert latest_stable_checkpoint_path(run) == run.checkpoint_step(1)
    with pytest.raises(CheckpointError, match="not a stable checkpoint"):
        load_checkpoint(run.checkpoint_step(2))


def test_disk_full_mid_write_keeps_previous_stable_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = new_run(tmp_path, "run_a")
    save_checkpoint(run, 1, *state(1.0), RunProgress(step=1))

    def full_disk(directory: Path, _state: dict) -> None:
        (directory / "tensors.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "write_snapshot_into", full_disk)
    with pytest.raises(CheckpointError, match="No space left"):
        save_checkpoint(run, 2, *state(2.0), RunProgress(step=2))
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step_1"]
    latest = latest_stable_checkpoint_path(run)
    assert latest is not None
    assert torch.equal(load_checkpoint(latest).adapter["layer.lora_A.weight"], torch.full((2, 3), 1.0))


def test_disk_full_while_marking_stable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = new_run(tmp_path, "run_a")
    save_checkpoint(run, 1, *state(1.0), RunProgress(step=1))
    real = checkpoint_module.write_file_atomic

    def full_on_marker(path: Path, data: bytes) -> None:
        if path.name == STABLE_MARKER:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(checkpoint_module, "write_file_atomic", full_on_marker)
    with pytest.raises(CheckpointError):
        save_checkpoint(run, 2, *state(2.0), RunProgress(step=2))
    assert latest_stable_checkpoint_path(run) == run.checkpoint_step(1)
    assert load_checkpoint(run.checkpoint_step(1)).progress.step == 1
