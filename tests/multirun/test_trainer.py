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
    iterate_until,
    make_runs,
    make_trainer,
    new_train_run,
    shared_model,
    synthetic_batch,
    train_alone,
    train_until,
    write_synthetic,
)
from safetensors.torch import save_file
from test_sync_multirank import run_world

from rlplex.multirun.rundir import RunDir
from rlplex.multirun.rundir.checkpoint import latest_stable_checkpoint_path, load_checkpoint
from rlplex.multirun.rundir.rollouts import ROLLOUT_FILE
from rlplex.multirun.trainer.log import read_progress_csv
from rlplex.multirun.trainer.loop import TIMES_FILE


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
    trainer.flush()
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
        run = new_train_run(tmp_path, run_id)
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
    trainer.flush()
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


@pytest.mark.slow
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


def test_a_stop_request_ends_the_loop_with_a_checkpoint_of_each_run(tmp_path: Path) -> None:
    make_runs(tmp_path, ["run_c"], steps=2)
    trainer = make_trainer(tmp_path, 1, checkpoint_every=10)
    train_until(trainer, {"run_c": 2})
    assert latest_stable_checkpoint_path(RunDir(tmp_path, "run_c")) is None  # not a checkpoint step
    trainer.request_stop()  # what SIGTERM does (the control plane's stop of the trainer role)
    assert trainer.run(until_idle_s=60) == 0
    assert latest_stable_checkpoint_path(RunDir(tmp_path, "run_c")) == RunDir(tmp_path, "run_c").checkpoint_step(2)


def test_a_run_naming_another_model_is_rejected_with_the_reason(tmp_path: Path) -> None:
    from lm_models import random_llama

    new_run(tmp_path, "run_other", model={"name": str(random_llama())})
    make_runs(tmp_path, ["run_c"], steps=1)
    trainer = make_trainer(tmp_path, 2)
    trainer.iteration()
    assert sorted(trainer.manager.id_2_idx) == ["run_c"]
    assert trainer.manager.run_statuses()["run_other"] == "rejected"
    reason = RunDir(tmp_path, "run_other").config_error.read_text()
    assert "field 'model.name'" in reason and "random-llama" in reason and "is not this trainer's model" in reason


@pytest.mark.e2e
def test_cli_runs_a_job_that_takes_the_model_and_stops_after_steps(tmp_path: Path) -> None:
    import json
    import signal

    from rlplex.multirun.trainer.main import main

    make_runs(tmp_path, ["run_c"], steps=3)
    handlers = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))
    try:
        model = json.dumps({"name": shared_model().name, "device": "cpu"})
        args = ["--output-dir", str(tmp_path), "--max-runs", "1", "--model-json", model]
        assert main([*args, "--steps", "2"]) == 0
    finally:
        signal.signal(signal.SIGTERM, handlers[0])
        signal.signal(signal.SIGINT, handlers[1])
    assert [r["step"] for r in read_progress_csv(RunDir(tmp_path, "run_c"))] == [1, 2]
    assert latest_stable_checkpoint_path(RunDir(tmp_path, "run_c")) == RunDir(tmp_path, "run_c").checkpoint_step(2)
    # Not under torchrun, the command ran the trainer as a control-plane job of its own.
    assert (tmp_path / "trainer_job" / "job.sqlite").is_file()
    # Where its two training iterations spent their time (benchmarks.multirun_throughput reads it).
    times = json.loads((tmp_path / TIMES_FILE).read_text())
    assert times["iterations"] == 2 and times["forward_backward_s"] > 0 and times["optimizer_s"] > 0
    parts = times["forward_backward_s"] + times["optimizer_s"] + times["host_s"]
    assert abs(parts - times["wall_s"]) < 1e-6 and 0 <= times["host_fraction"] < 1, times


def _new_finishing_run(output_dir: Path, run_id: str = "run_b0", steps: int = 2) -> RunDir:
    """A run of `steps` steps (a name sorted before run_c, so it is admitted first)."""
    run = new_train_run(output_dir, run_id, max_steps=steps, optim={"lr": 0.01})
    write_synthetic(output_dir, run_id, range(steps), seed=5)
    return run


def _mtime(path: Path) -> int:
    return path.stat().st_mtime_ns


def test_finished_run_frees_its_slot_for_a_waiting_run_and_is_not_readmitted(tmp_path: Path, alone: dict) -> None:
    run = _new_finishing_run(tmp_path)
    make_runs(tmp_path, ["run_c"])
    trainer = make_trainer(tmp_path, 1, **PACKED)
    train_until(trainer, {"run_b0": 2})
    assert trainer.manager.run_statuses() == {"run_b0": "active", "run_c": "waiting"}
    # The marker is queued behind the final step's outputs; the scan after it frees the slot.
    iterate_until(trainer, lambda: "run_c" in trainer.manager.id_2_idx, "run_c to take the freed slot")
    assert run.finished_step() == 2
    # Written after the final checkpoint and broadcast were marked STABLE.
    assert _mtime(run.finished) >= _mtime(run.checkpoint_step(2) / "STABLE")
    assert _mtime(run.finished) >= _mtime(run.broadcast_step(2) / "STABLE")
    assert trainer.manager.run_statuses() == {"run_b0": "finished", "run_c": "active"}
    assert trainer.manager.status_reason("run_b0") == "finished: trained 2 steps"
    assert trainer.manager.id_2_idx == {"run_c": 0} and sorted(trainer.optim.optimizers) == [0]
    train_until(trainer, {"run_c": STEPS})
    # The reused slot carried nothing of run_b0 over: run_c trains as it does alone.
    assert_same_weights(broadcast_weights(tmp_path, "run_c", STEPS), alone["run_c"])
    assert [r["step"] for r in read_progress_csv(run)] == [1, 2]
    restarted = make_trainer(tmp_path, 2, **PACKED)
    restarted.iteration()
    assert "run_b0" not in restarted.manager.id_2_idx
    assert restarted.manager.run_statuses()["run_b0"] == "finished"


def test_stop_and_restart_mark_a_run_at_its_last_step_finished(tmp_path: Path) -> None:
    stopped = _new_finishing_run(tmp_path / "stop")
    trainer = make_trainer(tmp_path / "stop", 1, checkpoint_every=10)
    train_until(trainer, {"run_b0": 2})
    assert not stopped.is_finished()  # train_until returns before the iteration that queues the marker
    trainer.finish()  # the stop path (SIGTERM, the control plane's stop) marks it
    assert stopped.finished_step() == 2

    crashed = _new_finishing_run(tmp_path / "crash")
    first = make_trainer(tmp_path / "crash", 1, checkpoint_every=10)
    train_until(first, {"run_b0": 2})  # ...and the trainer dies before it marks the run finished
    stamp = _mtime(crashed.checkpoint_step(2) / "STABLE")
    second = make_trainer(tmp_path / "crash", 1, checkpoint_every=10)
    statuses = second.manager.run_statuses
    iterate_until(second, lambda: statuses().get("run_b0") == "finished", "the resumed run to be marked finished")
    assert crashed.finished_step() == 2 and second.manager.id_2_idx == {}
    assert _mtime(crashed.checkpoint_step(2) / "STABLE") == stamp  # resumed at step 2: nothing written again
    assert [r["step"] for r in read_progress_csv(crashed)] == [1, 2]  # and no step trained twice


def test_final_checkpoint_that_fails_is_retried_before_the_run_is_marked_finished(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = _new_finishing_run(tmp_path)
    run.checkpoints.write_text("in the way")  # the checkpoint cannot be written (like a full disk)
    trainer = make_trainer(tmp_path, 1, checkpoint_every=10, output_retry_s=0.05)
    train_until(trainer, {"run_b0": 2})
    for _ in range(3):
        trainer.iteration()
    trainer.flush()
    assert not run.is_finished() and trainer.manager.id_2_idx == {"run_b0": 0}
    # The broadcast waits behind its checkpoint: a resume never trains a published step twice.
    assert "not marked finished at step 2: checkpoint step 2 and broadcast step 2 not STABLE" in caplog.text
    assert "broadcast step 2 not written: withheld until a checkpoint is written" in caplog.text
    run.checkpoints.unlink()  # space again
    iterate_until(trainer, lambda: "run_b0" not in trainer.manager.id_2_idx, "the retried finish")
    assert run.finished_step() == 2 and trainer.manager.id_2_idx == {}
    assert load_checkpoint(run.checkpoint_step(2)).progress.step == 2
    assert [r["step"] for r in read_progress_csv(run)] == [1, 2]
