"""MultiRunTrainer at world size 1 (in process) and 2 (two processes, gloo): isolation, eviction,
deletion, resume into another slot and another world size."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from mr_helpers import new_run
from mr_train_helpers import (
    PACKED,
    RUNS,
    STEPS,
    assert_same_weights,
    broadcast_weights,
    make_runs,
    make_trainer,
    synthetic_batch,
    train_alone,
    train_until,
    write_synthetic,
)
from safetensors.torch import save_file
from test_sync_multirank import run_world

from rlplex.multirun.checkpoint import latest_stable_checkpoint_path
from rlplex.multirun.rollout_io import ROLLOUT_FILE
from rlplex.multirun.rundir import RunDir
from rlplex.multirun.trainer_log import read_progress_csv


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """Each run of RUNS trained alone in its own trainer (one slot, big micro-batches)."""
    return {name: train_alone(tmp_path_factory.mktemp(name), name) for name in RUNS}


def test_runs_trained_together_equal_runs_trained_alone(tmp_path: Path, alone: dict) -> None:
    make_runs(tmp_path, list(RUNS))
    trainer = make_trainer(tmp_path, 4, **PACKED)
    mixed = 0
    for _ in range(200):
        ids = trainer.manager.id_2_idx
        if len(ids) == len(RUNS) and all(trainer.manager.progress[idx].step >= STEPS for idx in ids.values()):
            break
        prepared = trainer.prepare()
        mixed += sum(len(set(m.adapter_ids.tolist())) > 1 for m in prepared.micro_batches)
        trainer.execute(prepared)
    assert mixed > 0, "no micro-batch mixed runs: the test would not test isolation"
    for name in RUNS:
        run = RunDir(tmp_path, name)
        assert all((run.broadcast_step(s) / "STABLE").exists() for s in range(STEPS + 1)), name
        assert latest_stable_checkpoint_path(run) == run.checkpoint_step(STEPS)
        assert_same_weights(broadcast_weights(tmp_path, name, STEPS), alone[name])
        initial = broadcast_weights(tmp_path, name, 0)
        assert any(not torch.equal(initial[k], alone[name][k]) for k in initial), f"{name} did not train"
        rows = read_progress_csv(run)
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert rows[-1]["total_samples"] == STEPS * RUNS[name][1].get("n", 6)
    b_rows = read_progress_csv(RunDir(tmp_path, "run_b"))
    assert all(r["grad_norm"] > 0.05 for r in b_rows)  # run_b's clipping threshold was active
    a_rows = read_progress_csv(RunDir(tmp_path, "run_a"))
    assert a_rows[1]["lr"] == pytest.approx(0.01 * (1 - 0.9 / 4))  # run_a's own 4-step schedule


def _corrupt(run: RunDir, step: int, how: str) -> None:
    path = run.rollout_step(step) / ROLLOUT_FILE
    tensors = synthetic_batch(run.run_id, step).tensors()
    if how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return
    if how == "wrong shape":
        tensors["advantages"] = torch.zeros(7)
    elif how == "nan":
        tensors["rewards"][1] = float("nan")
    elif how == "dtype":
        tensors["tokens"] = tensors["tokens"].float()
    elif how == "empty":
        tensors = {name: t[:0] for name, t in tensors.items()}
    save_file(tensors, str(path))


BAD = {
    "wrong shape": "advantages has shape [7]",
    "nan": "rewards holds NaN",
    "dtype": "tokens must be torch.int64",
    "empty": "tokens must be [n >= 1",
    "truncated": "unreadable rollouts",
}


def test_malformed_rollouts_evict_only_that_run(tmp_path: Path, alone: dict) -> None:
    make_runs(tmp_path, ["run_a"])
    bad = {f"run_bad{i}": how for i, how in enumerate(BAD)}
    for run_id, how in bad.items():
        run = new_run(tmp_path, run_id)
        write_synthetic(tmp_path, run_id, range(1))
        _corrupt(run, 0, how)
    trainer = make_trainer(tmp_path, 1 + len(bad), **PACKED)
    trainer.iteration()
    for run_id, how in bad.items():
        reason = RunDir(tmp_path, run_id).eviction_reason()
        assert reason is not None and BAD[how] in reason and ROLLOUT_FILE in reason, (how, reason)
    train_until(trainer, {"run_a": STEPS})
    assert sorted(trainer.manager.id_2_idx) == ["run_a"]
    assert sorted(trainer.optim.optimizers) == [trainer.manager.id_2_idx["run_a"]]
    assert all(trainer.manager.run_statuses()[run_id] == "evicted" for run_id in bad)
    assert_same_weights(broadcast_weights(tmp_path, "run_a", STEPS), alone["run_a"])


def test_run_deleted_mid_training_is_forgotten_and_its_slot_reused(tmp_path: Path, alone: dict) -> None:
    make_runs(tmp_path, ["run_a", "run_b"])
    trainer = make_trainer(tmp_path, 2, **PACKED)
    trainer.iteration()  # run_b's first step is only partly packed: its gradients are accumulating
    b_slot = trainer.manager.id_2_idx["run_b"]
    assert b_slot in trainer.packer.pending and trainer.packer.pending[b_slot].cursor > 0
    for _ in range(50):
        prepared = trainer.prepare()
        if b_slot in {s.idx for s in prepared.steps}:
            break
        trainer.execute(prepared)
    shutil.rmtree(tmp_path / "run_b")  # deleted between packing and the writes of its step
    trainer.execute(prepared)
    assert not (tmp_path / "run_b").exists()
    trainer.iteration()
    assert "run_b" not in trainer.manager.id_2_idx and b_slot not in trainer.optim.optimizers
    make_runs(tmp_path, ["run_c"])  # takes the freed slot; must not inherit run_b's gradients
    train_until(trainer, {"run_a": STEPS, "run_c": STEPS})
    assert trainer.manager.id_2_idx["run_c"] == b_slot
    assert not (tmp_path / "run_b").exists()
    assert_same_weights(broadcast_weights(tmp_path, "run_c", STEPS), alone["run_c"])
    assert_same_weights(broadcast_weights(tmp_path, "run_a", STEPS), alone["run_a"])


def test_resume_from_checkpoint_into_another_slot(tmp_path: Path) -> None:
    reference = train_alone(tmp_path / "ref", "run_a", steps=4, run_id="run_r")
    out = tmp_path / "out"
    out.mkdir()
    make_runs(out, ["run_b"], as_name={"run_b": "run_0"})
    make_runs(out, ["run_a"], steps=2, as_name={"run_a": "run_r"})
    first = make_trainer(out, 2, **PACKED)
    train_until(first, {"run_r": 2})
    assert first.manager.id_2_idx["run_r"] == 1
    first.finish()
    shutil.rmtree(out / "run_0")
    write_synthetic(out, "run_r", range(2, 4), **RUNS["run_a"][1])
    second = make_trainer(out, 2, **PACKED)
    second.iteration()
    assert second.manager.id_2_idx["run_r"] == 0 and second.manager.resume_step(0) == 2
    train_until(second, {"run_r": 4})
    assert_same_weights(broadcast_weights(out, "run_r", 4), reference)


def test_world_size_2_isolation_and_resume_across_world_sizes(tmp_path: Path, alone: dict) -> None:
    # Part of a run trained at world size 1, resumed by the two-rank trainer below.
    prepared = tmp_path / "resume"
    prepared.mkdir()
    make_runs(prepared, ["run_c"], steps=1, as_name={"run_c": "run_0"})
    make_runs(prepared, ["run_a"], steps=2, as_name={"run_a": "run_r"})
    first = make_trainer(prepared, 2, **PACKED)
    train_until(first, {"run_r": 2})
    first.finish()
    shutil.rmtree(prepared / "run_0")
    write_synthetic(prepared, "run_r", range(2, 4), **RUNS["run_a"][1])
    results = run_world("train", tmp_path, worker="mr_train_worker.py")
    assert results[0]["slots"] == results[1]["slots"]
    for name in RUNS:
        assert_same_weights(broadcast_weights(tmp_path / "iso", name, STEPS), alone[name])
    reference = train_alone(tmp_path / "ref", "run_a", steps=4, run_id="run_r")
    assert_same_weights(broadcast_weights(prepared, "run_r", 4), reference)
    assert results[0]["resume_slot"] == 0 and results[0]["resume_step"] == 2
