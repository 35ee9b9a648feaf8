"""Issue 14: one run's bad file, or a crash, never stops the trainer, trains a step twice or hands
a run another run's state. One test per hole, each on a real trainer (tiny Qwen3, world size 1)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from mr_train_helpers import (
    RUNS,
    STEPS,
    assert_same_weights,
    broadcast_weights,
    iterate_until,
    make_runs,
    make_trainer,
    new_train_run,
    synthetic_batch,
    train_alone,
    train_until,
    write_synthetic,
)

from disk_helpers import SmallDisk, small_disk
from rlplex.errors import RunConfigError
from rlplex.multirun.orchestrator.config import orch_config_to_toml, read_orch_config
from rlplex.multirun.orchestrator.loop import RunEvictedError, WaitOptions, check_evicted, open_run, wait_for_broadcast
from rlplex.multirun.rundir import RunDir, stable_steps, write_eviction, write_finished
from rlplex.multirun.rundir.checkpoint import PROGRESS_FILE, stable_checkpoints
from rlplex.multirun.rundir.peft_export import ADAPTER_WEIGHTS, is_stable_adapter
from rlplex.multirun.rundir.rollouts import ROLLOUT_FILE, write_rollouts
from rlplex.multirun.trainer.log import read_progress_csv
from rlplex.multirun.trainer.loop import MultiRunTrainer


def _iterate(trainer: MultiRunTrainer, times: int = 1) -> None:
    for _ in range(times):
        trainer.iteration()
    trainer.flush()


def _in_thread(action: Callable[[], None], timeout_s: float = 60) -> None:
    """Run `action`, failing (instead of hanging the suite) if it blocks."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            action()
        except BaseException as error:  # re-raised in the test's thread
            errors.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"blocked for {timeout_s} s"
    if errors:
        raise errors[0]


# ---- 1 and 8: unreadable checkpoints ----------------------------------------------------------------
def test_unreadable_checkpoints_fall_back_or_evict_and_never_stop_the_trainer(tmp_path: Path) -> None:
    make_runs(tmp_path, ["run_a", "run_b"])
    first = make_trainer(tmp_path, 2, checkpoint_every=1)
    train_until(first, {"run_a": 2, "run_b": 2})
    a, b = RunDir(tmp_path, "run_a"), RunDir(tmp_path, "run_b")
    (a.checkpoint_step(2) / "tensors.safetensors").write_bytes(b"truncated")  # the newest one of run_a
    for _, path in stable_checkpoints(b):
        (path / PROGRESS_FILE).unlink()  # every checkpoint of run_b
    make_runs(tmp_path, ["run_c"])
    second = make_trainer(tmp_path, 3, checkpoint_every=1)
    _iterate(second)
    statuses = second.manager.run_statuses()
    assert statuses["run_a"] == "active" and statuses["run_c"] == "active"
    # run_a: optimizer from step 1, adapter and step from broadcast 2 (nothing lost or trained again).
    assert second.manager.resume_step(second.manager.id_2_idx["run_a"]) == 1
    assert second.manager.progress[second.manager.id_2_idx["run_a"]].step >= 2
    assert statuses["run_b"] == "evicted"
    reason = b.eviction_reason() or ""
    assert "cannot resume" in reason and PROGRESS_FILE in reason
    train_until(second, {"run_a": STEPS, "run_c": STEPS})
    assert [int(r["step"]) for r in read_progress_csv(a)] == list(range(1, STEPS + 1))


# ---- 2: non-finite steps ----------------------------------------------------------------------------
def test_a_step_with_non_finite_loss_is_skipped_and_its_run_evicted(tmp_path: Path) -> None:
    alone = train_alone(tmp_path / "alone", "run_a")
    out = tmp_path / "shared"
    make_runs(out, ["run_a"])
    new_train_run(out, "run_huge")
    for step in range(STEPS):
        batch = synthetic_batch("run_huge", step)
        batch.advantages = torch.full_like(batch.advantages, 3e38)  # finite, so it passes validation
        write_rollouts(RunDir(out, "run_huge"), batch)
    trainer = make_trainer(out, 2)
    train_until(trainer, {"run_a": STEPS})
    huge = RunDir(out, "run_huge")
    reason = huge.eviction_reason() or ""
    assert "not finite" in reason and "optimizer step was skipped" in reason, reason
    assert [step for step, _ in stable_steps(huge.broadcast)] == [0]  # nothing after the bad step
    assert stable_checkpoints(huge) == []
    assert "run_huge" not in trainer.manager.id_2_idx
    assert_same_weights(broadcast_weights(out, "run_a", STEPS), alone)


# ---- 3: a run made again under the same name -----------------------------------------------------
def test_a_run_made_again_under_its_name_starts_afresh_and_old_writes_are_dropped(tmp_path: Path) -> None:
    alone = train_alone(tmp_path / "alone", "run_a")
    out = tmp_path / "shared"
    make_runs(out, ["run_a"])
    trainer = make_trainer(out, 1)
    train_until(trainer, {"run_a": 2})
    old_identity = RunDir(out, "run_a").read_identity()
    # Hold the writer so that a checkpoint of the old run is still queued when it is replaced.
    gate = threading.Event()
    trainer.outputs.writer.submit(lambda: gate.wait(30) or None)
    trainer.outputs.checkpoint(trainer.manager.id_2_idx["run_a"], "run_a", 2)
    shutil.rmtree(out / "run_a")
    make_runs(out, ["run_a"])  # same name (ext4 often hands back the same inode), new identity
    gate.set()
    trainer.flush()
    new = RunDir(out, "run_a")
    assert new.read_identity() not in (None, old_identity)
    assert stable_checkpoints(new) == []  # the old run's queued checkpoint did not land here
    train_until(trainer, {"run_a": STEPS})
    assert [int(r["step"]) for r in read_progress_csv(new)] == list(range(1, STEPS + 1))
    assert_same_weights(broadcast_weights(out, "run_a", STEPS), alone)  # trained from scratch


def test_a_bound_run_dir_refuses_writes_once_its_identity_changes(tmp_path: Path) -> None:
    run = new_train_run(tmp_path, "run_x")
    bound = run.bound(run.ensure_identity())
    bound.write_text(bound.root / "note.txt", "mine")
    run.identity_file.unlink()
    with pytest.raises(Exception, match="replaced"):
        bound.write_text(bound.root / "note.txt", "not mine")
    assert (run.root / "note.txt").read_text() == "mine"


# ---- 4: an active run's orch.toml is frozen ------------------------------------------------------
def test_an_active_runs_config_is_frozen_on_both_sides(tmp_path: Path) -> None:
    make_runs(tmp_path, ["run_a", "run_c"])
    trainer = make_trainer(tmp_path, 2)
    train_until(trainer, {"run_a": 1, "run_c": 1})
    run = RunDir(tmp_path, "run_a")
    config = read_orch_config(run.orch_config)
    run.write_text(run.orch_config, orch_config_to_toml(config) + "\n# rewritten, same config\n")
    _iterate(trainer)
    assert trainer.manager.run_statuses()["run_a"] == "active"
    changed = config.model_copy(update={"temperature": 0.5})
    with pytest.raises(RunConfigError, match=r"temperature: 1\.0 -> 0\.5"):
        open_run(tmp_path, "run_a", changed)  # the orchestrator refuses to change it
    run.write_text(run.orch_config, orch_config_to_toml(changed))  # someone else does anyway
    _iterate(trainer, 2)
    reason = run.eviction_reason() or ""
    assert "temperature: 1.0 -> 0.5" in reason and "frozen" in reason, reason
    assert "run_a" not in trainer.manager.id_2_idx
    train_until(trainer, {"run_c": STEPS})


def test_an_orchestrator_waiting_for_a_broadcast_notices_finished_and_evicted(tmp_path: Path) -> None:
    run = new_train_run(tmp_path, "run_w")
    write_finished(run, 2)
    with pytest.raises(RunConfigError, match="finished at step 2"):
        wait_for_broadcast(run, 5, "step 5", WaitOptions(timeout_s=30, poll_s=0.01))
    other = new_train_run(tmp_path, "run_v")
    other.write_text(other.evicted, "gone\n")
    with pytest.raises(Exception, match="evicted: gone"):
        wait_for_broadcast(other, 5, "step 5", WaitOptions(timeout_s=30, poll_s=0.01))


# ---- 5: an eviction whose marker cannot be written -----------------------------------------------
def test_an_eviction_a_read_only_run_folder_refuses_is_recorded_beside_it_and_drops_the_run(tmp_path: Path) -> None:
    """The trainer's eviction of a run whose folder is read-only, and (issue 31, hole 4) a run's own
    eviction by its orchestrator when its folder turned read-only, both land beside the runs."""
    make_runs(tmp_path, ["run_a", "run_c"])
    bad = new_train_run(tmp_path, "run_bad")
    write_synthetic(tmp_path, "run_bad", range(1))
    (bad.rollout_step(0) / ROLLOUT_FILE).write_bytes(b"garbage")
    run_c = RunDir(tmp_path, "run_c")
    with small_disk(bad.root) as bad_disk, small_disk(run_c.root) as c_disk:
        bad_disk.read_only()
        trainer = make_trainer(tmp_path, 3)
        _iterate(trainer, 2)
        assert "run_bad" not in trainer.manager.id_2_idx and not bad.is_evicted()
        assert trainer.manager.run_statuses()["run_bad"] == "evicted"
        reason = bad.unwritten_eviction() or ""  # what `rlplex status` shows
        assert ROLLOUT_FILE in reason and "Read-only file system" in reason, reason
        train_until(trainer, {"run_c": 1})
        c_disk.read_only()
        write_eviction(run_c.bound(run_c.read_identity()), "progress.csv not written: Read-only file system")
        assert not run_c.is_evicted() and "Read-only" in (run_c.unwritten_eviction() or "")
        _iterate(trainer)
        assert trainer.manager.run_statuses()["run_c"] == "evicted" and "run_c" not in trainer.manager.id_2_idx
        train_until(trainer, {"run_a": STEPS})
        again = make_trainer(tmp_path, 3)  # a restarted trainer keeps both out
        _iterate(again)
        statuses = again.manager.run_statuses()
        assert statuses["run_bad"] == statuses["run_c"] == "evicted"
        assert set(again.manager.id_2_idx) <= {"run_a"}


def test_a_control_folder_that_is_a_symlink_does_not_stop_the_trainer(tmp_path: Path) -> None:
    make_runs(tmp_path, ["run_a", "run_c"])
    trainer = make_trainer(tmp_path, 2)
    train_until(trainer, {"run_a": 1, "run_c": 1})
    run = RunDir(tmp_path, "run_c")
    elsewhere = tmp_path / "elsewhere"
    shutil.move(run.control, elsewhere)
    os.symlink(elsewhere, run.control)
    train_until(trainer, {"run_a": STEPS})
    assert "run_c" not in trainer.manager.id_2_idx
    assert trainer.manager.run_statuses()["run_c"] in ("rejected", "evicted")


# ---- 6: files that are not regular files ---------------------------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "folder_outside"])
def test_rollout_files_that_are_not_regular_files_evict_only_that_run(tmp_path: Path, kind: str) -> None:
    make_runs(tmp_path, ["run_a"])
    bad = new_train_run(tmp_path, "run_bad")
    write_synthetic(tmp_path, "run_bad", range(1))
    target = bad.rollout_step(0) / ROLLOUT_FILE
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", target)
    else:
        outside = tmp_path / "outside_step"
        shutil.move(bad.rollout_step(0), outside)
        write_synthetic(tmp_path, "run_a", range(0))
        shutil.copy(RunDir(tmp_path, "run_a").rollout_step(0) / ROLLOUT_FILE, outside / ROLLOUT_FILE)
        os.symlink(outside, bad.rollout_step(0))
    trainer = make_trainer(tmp_path, 2)
    _in_thread(lambda: _iterate(trainer, 2))
    reason = bad.eviction_reason() or ""
    assert ROLLOUT_FILE in reason or "outside" in reason, reason
    train_until(trainer, {"run_a": STEPS})


# ---- 7: no step trained twice whatever checkpoint_every is ----------------------------------------
def test_a_restart_with_checkpoint_every_3_trains_no_step_twice(tmp_path: Path) -> None:
    make_runs(tmp_path, ["run_a"], steps=4)
    first = make_trainer(tmp_path, 1, checkpoint_every=3)
    train_until(first, {"run_a": 2})  # a crash: no stop path, the newest checkpoint is... none
    train_until(first, {"run_a": 4})
    run = RunDir(tmp_path, "run_a")
    assert [s for s, _ in stable_checkpoints(run)] == [3, 4]  # 4: the run's last step
    shutil.rmtree(run.checkpoint_step(4))  # the crash came before the last checkpoint
    (run.root / "control" / "finished.txt").unlink(missing_ok=True)
    second = make_trainer(tmp_path, 1, checkpoint_every=3)
    _iterate(second)
    idx = second.manager.id_2_idx.get("run_a")
    assert idx is not None and second.manager.resume_step(idx) == 3
    assert second.manager.progress[idx].step == 4
    resumed = {f"base_model.model.{k}": v for k, v in second.manager.get_state_dict_for_run(idx).items()}
    assert_same_weights(resumed, broadcast_weights(tmp_path, "run_a", 4), atol=0)
    second.finish()
    assert [int(r["step"]) for r in read_progress_csv(run)] == [1, 2, 3, 4]


def test_a_restart_mid_run_continues_after_the_newest_broadcast(tmp_path: Path) -> None:
    make_runs(tmp_path, ["run_c"], steps=6)
    config = {"checkpoint_every": 4}
    first = make_trainer(tmp_path, 1, **config)
    train_until(first, {"run_c": 2})
    del first  # killed: step 2 is broadcast, nothing checkpointed
    second = make_trainer(tmp_path, 1, **config)
    train_until(second, {"run_c": 3})
    steps = [int(r["step"]) for r in read_progress_csv(RunDir(tmp_path, "run_c"))]
    assert steps == [1, 2, 3], steps


def test_unreadable_adapters_past_the_checkpoint_evict_the_run_instead_of_training_again(tmp_path: Path) -> None:
    """Issue 31, hole 6: killed at step 3 with checkpoint_every 10 and every adapter truncated, the
    run used to start again from a fresh adapter and train steps 1-3 a second time."""
    make_runs(tmp_path, ["run_c", "run_a"], steps=6)
    config = {"checkpoint_every": 10}
    first = make_trainer(tmp_path, 2, **config)
    train_until(first, {"run_c": 3, "run_a": 3})
    del first  # killed: steps 1-3 broadcast, nothing checkpointed
    run = RunDir(tmp_path, "run_c")
    newer = [step for step, _ in stable_steps(run.broadcast) if step > 0]
    assert newer == [1, 2, 3]
    for step in newer:
        weights = run.broadcast_step(step) / ADAPTER_WEIGHTS
        weights.write_bytes(weights.read_bytes()[:100])
    second = make_trainer(tmp_path, 2, **config)
    _iterate(second)
    assert second.manager.run_statuses()["run_c"] == "evicted"
    reason = run.eviction_reason() or ""
    assert "none of them reads" in reason and "step 3" in reason and ADAPTER_WEIGHTS in reason, reason
    train_until(second, {"run_a": 4})  # the other run resumes from its own adapter
    assert [int(r["step"]) for r in read_progress_csv(run)] == [1, 2, 3]  # nothing trained twice
    assert [int(r["step"]) for r in read_progress_csv(RunDir(tmp_path, "run_a"))] == [1, 2, 3, 4]


# ---- issue 31, hole 3: a full disk ----------------------------------------------------------------
@contextmanager
def _run_on_a_full_disk(output_dir: Path, **trainer_config: object) -> Iterator[tuple[MultiRunTrainer, SmallDisk]]:
    """run_a on the test's disk; run_c admitted (its broadcast/step_0 written), its step 0's
    rollouts waiting, then its folder's disk filled: the trainer trains step 0 and cannot write
    checkpoint or broadcast step 1, which run_c's orchestrator would wait for."""
    make_runs(output_dir, ["run_a"])
    run = new_train_run(output_dir, "run_c", **RUNS["run_c"][0])
    with small_disk(run.root) as disk:
        trainer = make_trainer(output_dir, 2, output_retry_s=0.05, **trainer_config)
        _iterate(trainer)
        assert is_stable_adapter(run.broadcast_step(0))
        write_synthetic(output_dir, "run_c", range(1), **RUNS["run_c"][1])  # type: ignore[arg-type]
        disk.fill()
        yield trainer, disk


def test_a_disk_full_for_a_while_delays_a_run_and_its_outputs_come_when_space_returns(tmp_path: Path) -> None:
    run = RunDir(tmp_path, "run_c")
    with _run_on_a_full_disk(tmp_path, max_output_failures=10_000) as (trainer, disk):
        train_until(trainer, {"run_a": STEPS, "run_c": 1})
        iterate_until(trainer, lambda: trainer.outputs.retries.is_failing("run_c"), "run_c's outputs to fail")
        for _ in range(5):  # a few retries while the disk stays full
            _iterate(trainer)
        assert not is_stable_adapter(run.broadcast_step(1)) and not trainer.manager.is_leaving("run_c")
        disk.free()
        iterate_until(trainer, lambda: is_stable_adapter(run.broadcast_step(1)), "broadcast step 1 once space returned")
        assert [s for s, _ in stable_checkpoints(run)][-1] == 1  # checkpoint first, as always
        write_synthetic(tmp_path, "run_c", range(1, STEPS), **RUNS["run_c"][1])  # type: ignore[arg-type]
        train_until(trainer, {"run_c": STEPS})
        assert not trainer.outputs.retries.is_failing("run_c")
    # Nothing trained twice or lost: the weights of the run trained alone on a roomy disk.
    alone = train_alone(tmp_path / "alone", "run_c")
    assert_same_weights(broadcast_weights(tmp_path, "run_c", STEPS), alone)
    assert [int(r["step"]) for r in read_progress_csv(RunDir(tmp_path, "run_a"))] == list(range(1, STEPS + 1))


def test_a_disk_that_stays_full_evicts_its_run_alone_and_its_orchestrator_hears_why(tmp_path: Path) -> None:
    run = RunDir(tmp_path, "run_c")
    with _run_on_a_full_disk(tmp_path, max_output_failures=3) as (trainer, _):
        train_until(trainer, {"run_c": 1})
        iterate_until(trainer, lambda: trainer.manager.run_statuses().get("run_c") == "evicted", "run_c's eviction")
        reason = run.unwritten_eviction() or ""  # control/evicted.txt could not be written either
        assert reason.startswith(trainer.manager.status_reason("run_c") or "?")
        assert "failed 3 times in a row" in reason and "No space left on device" in reason, reason
        with pytest.raises(RunEvictedError, match="No space left on device"):
            check_evicted(run.bound(run.read_identity()))  # its orchestrator, waiting for step 1, gives up
        train_until(trainer, {"run_a": STEPS})
    assert [int(r["step"]) for r in read_progress_csv(RunDir(tmp_path, "run_a"))] == list(range(1, STEPS + 1))


# ---- 8: durability and clean-up -------------------------------------------------------------------
def test_orphaned_temporaries_are_removed_and_retention_keeps_the_newest(tmp_path: Path) -> None:
    make_runs(tmp_path, ["run_c"], steps=6)
    run = RunDir(tmp_path, "run_c")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = run.checkpoints / f".step_9.tmp-{int(dead.stdout)}"
    orphan.mkdir(parents=True)
    (orphan / "tensors.safetensors").write_bytes(b"half")
    retention = {"checkpoints": {"keep_last": 2}, "broadcast": {"keep_last": 3}, "rollouts": {"keep_last": 1}}
    trainer = make_trainer(tmp_path, 1, retention=retention)
    train_until(trainer, {"run_c": 6})
    assert not orphan.exists()
    assert [s for s, _ in stable_checkpoints(run)] == [5, 6]
    assert [s for s, _ in stable_steps(run.broadcast)] == [4, 5, 6]
    assert [s for s, _ in stable_steps(run.rollouts)] == [5]  # the newest consumed one is kept
    assert all(is_stable_adapter(run.broadcast_step(s)) for s in (4, 5, 6))


# ---- 9: stale rollouts ----------------------------------------------------------------------------
def test_rollouts_too_stale_are_dropped_with_a_count(tmp_path: Path) -> None:
    run = new_train_run(tmp_path, "run_s", max_async_level=1)
    for step in range(3):
        batch = synthetic_batch("run_s", step)
        batch.policy_step = 0  # step 2 comes from a policy 2 steps old
        write_rollouts(run, batch)
    too_eager = new_train_run(tmp_path, "run_eager", max_async_level=5)
    trainer = make_trainer(tmp_path, 2, max_off_policy_steps=1)
    train_until(trainer, {"run_s": 3})
    rows = read_progress_csv(run)
    assert [r["stale_dropped"] for r in rows] == [0, 0, 1]
    assert_same_weights(broadcast_weights(tmp_path, "run_s", 3), broadcast_weights(tmp_path, "run_s", 2), atol=0)
    assert trainer.manager.run_statuses()["run_eager"] == "rejected"
    assert "max_off_policy_steps 1" in (too_eager.config_error.read_text())
