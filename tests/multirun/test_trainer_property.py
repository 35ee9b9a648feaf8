"""A real trainer driven through random interleavings of run creation, deletion, re-creation
under the same name, eviction and malformed files (issue 14). After every action and trainer
iteration: the trainer is alive, and no run holds another run's adapter, progress or files."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
from mr_train_helpers import make_trainer, new_train_run, write_synthetic
from safetensors.torch import load_file

from rlplex.mainjob.view import read_progress_rows
from rlplex.multirun.rundir import RunDir, stable_steps
from rlplex.multirun.rundir.checkpoint import PROGRESS_FILE, stable_checkpoints
from rlplex.multirun.rundir.rollouts import ROLLOUT_FILE
from rlplex.multirun.trainer.log import progress_csv_path
from rlplex.multirun.trainer.loop import MultiRunTrainer

NAMES = ("run_p", "run_q", "run_r", "run_s")
DATA_STEPS = 5
ACTIONS = ("create", "create", "delete", "recreate", "evict", "malformed", "corrupt_checkpoint", "wait", "wait")


def _trained_steps(run: RunDir) -> list[int]:
    return [int(row["step"]) for row in read_progress_rows(Path(progress_csv_path(run)))]


def _create(out: Path, name: str, rng: random.Random) -> None:
    # Each incarnation gets its own data seed and LoRA rank: inherited state would not fit it.
    new_train_run(out, name, max_steps=DATA_STEPS, model={"lora": {"rank": rng.choice([2, 4])}})
    write_synthetic(out, name, range(DATA_STEPS), seed=rng.randrange(1000))


def _act(out: Path, action: str, name: str, rng: random.Random) -> None:
    run = RunDir(out, name)
    if action == "create" and not run.exists():
        _create(out, name, rng)
    elif action == "delete":
        shutil.rmtree(run.root, ignore_errors=True)
    elif action == "recreate":
        shutil.rmtree(run.root, ignore_errors=True)
        _create(out, name, rng)
    elif action == "evict" and run.exists():
        run.write_text(run.evicted, "evicted by the test\n")
    elif action == "malformed" and run.exists():
        step = rng.randrange(DATA_STEPS)
        if (run.rollout_step(step) / ROLLOUT_FILE).exists():
            (run.rollout_step(step) / ROLLOUT_FILE).write_bytes(b"not safetensors")
    elif action == "corrupt_checkpoint" and run.exists():
        for _, path in stable_checkpoints(run)[-1:]:
            (path / PROGRESS_FILE).write_text("{broken")


def _check(trainer: MultiRunTrainer, out: Path) -> None:
    manager = trainer.manager
    for name in NAMES:
        run = RunDir(out, name)
        if not run.exists():
            assert name not in manager.id_2_idx, f"{name} deleted but still holds a slot"
            continue
        steps = _trained_steps(run)
        assert steps == list(range(1, len(steps) + 1)), f"{name}: a step trained twice or skipped: {steps}"
        n = len(steps)
        # Files of an earlier run under this name never land in this one.
        assert all(s <= n for s, _ in stable_steps(run.broadcast)), (name, n, stable_steps(run.broadcast))
        assert all(1 <= s <= n for s, _ in stable_checkpoints(run)), (name, n, stable_checkpoints(run))
        idx = manager.id_2_idx.get(name)
        if idx is None or manager.is_leaving(name):
            continue
        assert manager.run_dir(name).identity == run.read_identity(), f"{name}: the slot holds another run"
        assert manager.progress[idx].step == n, f"{name}: progress {manager.progress[idx].step}, trained {n}"
        rank = manager.config[idx].model.lora.rank
        state = manager.get_state_dict_for_run(idx)
        assert all(min(t.shape) == rank for t in state.values()), f"{name}: adapter of another rank"
        if n and (run.broadcast_step(n) / "STABLE").exists():
            published = load_file(str(run.broadcast_step(n) / "adapter_model.safetensors"))
            for key, tensor in state.items():
                assert torch.equal(published[f"base_model.model.{key}"], tensor), f"{name}: {key} is not its own"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_interleavings_keep_runs_apart_and_the_trainer_alive(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    trainer = make_trainer(tmp_path, 2, micro_tokens=40, micro_batches=2)
    for name in NAMES[:2]:
        _create(tmp_path, name, rng)
    for _ in range(30):
        action, name = rng.choice(ACTIONS), rng.choice(NAMES)
        _act(tmp_path, action, name, rng)
        for _ in range(rng.randint(1, 3)):
            trainer.iteration()
        trainer.flush()
        _check(trainer, tmp_path)
    statuses = trainer.manager.run_statuses()
    assert set(statuses) <= set(NAMES)
