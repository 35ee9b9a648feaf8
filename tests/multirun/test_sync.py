"""synchronize_state(): the protocol at world size 1, and two ranks as threads over one in-process store.

The real multi-process gloo tests are in test_sync_multirank.py; threads here keep the
protocol checks fast (one HashStore, no process start-up).
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from mr_helpers import StandInLora, new_run

from rlplex.errors import HookMismatchError, WaitTimeoutError
from rlplex.multirun import EMPTY_SLOT_SCALING, MultiRunManager


def run_ranks(*bodies: Callable[[], Any], timeout_s: float = 20.0) -> list[BaseException | None]:
    errors: list[BaseException | None] = [None] * len(bodies)

    def wrap(i: int) -> None:
        try:
            bodies[i]()
        except BaseException as error:
            errors[i] = error

    threads = [threading.Thread(target=wrap, args=(i,), daemon=True) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
        assert not thread.is_alive(), "a rank is stuck"
    return errors


def pair(tmp_path: Path, max_runs: int = 3, timeout_s: float = 10.0) -> tuple[MultiRunManager, MultiRunManager]:
    store = dist.HashStore()
    kwargs: dict[str, Any] = {"store": store, "world_size": 2, "sync_timeout_s": timeout_s}
    return MultiRunManager(tmp_path, max_runs, rank=0, **kwargs), MultiRunManager(tmp_path, max_runs, rank=1, **kwargs)


def test_world_size_1_deletion_hooks_before_creation_hooks_in_registration_order(tmp_path: Path) -> None:
    mrm = MultiRunManager(tmp_path, 2)
    calls: list[str] = []
    mrm.register_creation_hook(lambda idx, run_id: calls.append(f"create1 {idx} {run_id}"))
    mrm.register_deletion_hook(lambda idx, run_id: calls.append(f"delete1 {idx} {run_id}"))
    mrm.register_creation_hook(lambda idx, run_id: calls.append(f"create2 {idx} {run_id}"))
    mrm.register_deletion_hook(lambda idx, run_id: calls.append(f"delete2 {idx} {run_id}"))
    new_run(tmp_path, "run_a")
    mrm.discover_runs()
    mrm.synchronize_state()
    assert calls == ["create1 0 run_a", "create2 0 run_a"]
    calls.clear()
    mrm.synchronize_state()
    assert calls == []
    shutil.rmtree(tmp_path / "run_a")
    new_run(tmp_path, "run_b")
    mrm.discover_runs()
    mrm.synchronize_state()
    assert calls == ["delete1 0 run_a", "delete2 0 run_a", "create1 0 run_b", "create2 0 run_b"]


def test_creation_hook_resets_the_new_runs_lora_slot(tmp_path: Path) -> None:
    mrm = MultiRunManager(tmp_path, 2)
    layer = StandInLora(2, rank=8)
    mrm.register_lora_module("layer", layer)
    new_run(tmp_path, "run_a")
    mrm.discover_runs()
    assert layer.lora_B[0].abs().sum() > 0
    mrm.synchronize_state()
    assert layer.lora_B[0].abs().sum() == 0 and layer.lora_B[1].abs().sum() > 0


def test_rank1_catches_up_and_both_run_the_same_hooks(tmp_path: Path) -> None:
    master, other = pair(tmp_path)
    seen: dict[int, list[str]] = {0: [], 1: []}
    for rank, mrm in ((0, master), (1, other)):
        mrm.register_deletion_hook(lambda idx, run_id, r=rank: seen[r].append(f"delete {idx} {run_id}"))
        mrm.register_creation_hook(lambda idx, run_id, r=rank: seen[r].append(f"create {idx} {run_id}"))
    new_run(tmp_path, "run_a", model={"lora": {"rank": 4, "alpha": 8.0}}, seed=3)
    new_run(tmp_path, "run_b")
    master.discover_runs()
    master.record_progress(0, tokens=10, samples=2)
    assert run_ranks(master.synchronize_state, other.synchronize_state) == [None, None]
    assert other.idx_2_id == {0: "run_a", 1: "run_b"} and other.id_2_idx == master.id_2_idx
    assert other.config == master.config and other.config[0].seed == 3
    assert other.scaling_factors.tolist() == [2.0, 2.0, EMPTY_SLOT_SCALING]
    assert other.lora_ranks.tolist() == [4, 8, 0]
    assert other.progress[0].total_tokens == 10
    assert seen[1] == seen[0] == ["create 0 run_a", "create 1 run_b"]

    shutil.rmtree(tmp_path / "run_a")
    new_run(tmp_path, "run_c")
    master.discover_runs()
    master.record_progress(1, tokens=5, samples=1)
    seen[0].clear()
    seen[1].clear()
    assert run_ranks(master.synchronize_state, other.synchronize_state) == [None, None]
    assert other.idx_2_id == {0: "run_c", 1: "run_b"}
    assert other.progress[1].step == 1
    assert seen[1] == seen[0] == ["delete 0 run_a", "create 0 run_c"]


def test_same_run_id_back_in_the_same_slot_still_runs_the_hooks(tmp_path: Path) -> None:
    master, other = pair(tmp_path, max_runs=1)
    seen: list[str] = []
    other.register_deletion_hook(lambda idx, run_id: seen.append(f"delete {run_id}"))
    other.register_creation_hook(lambda idx, run_id: seen.append(f"create {run_id}"))
    master.register_deletion_hook(lambda idx, run_id: None, name=other.hooks.deletion.names()[-1])
    master.register_creation_hook(lambda idx, run_id: None, name=other.hooks.creation.names()[-1])
    run = new_run(tmp_path, "run_a")
    master.discover_runs()
    assert run_ranks(master.synchronize_state, other.synchronize_state) == [None, None]
    master.evict_run(0, "x")
    master.discover_runs()
    run.evicted.unlink()
    master.discover_runs()  # evicted and back between two syncs: a new incarnation
    assert run_ranks(master.synchronize_state, other.synchronize_state) == [None, None]
    assert seen == ["create run_a", "delete run_a", "create run_a"]


def test_store_keys_are_cleaned_up(tmp_path: Path) -> None:
    master, other = pair(tmp_path)
    new_run(tmp_path, "run_a")
    master.discover_runs()
    store = master._store
    assert store is not None
    for _ in range(5):
        assert run_ranks(master.synchronize_state, other.synchronize_state) == [None, None]
    assert store.num_keys() == 0


def test_mismatched_hook_registration_raises_on_every_rank(tmp_path: Path) -> None:
    master, other = pair(tmp_path)

    def optimizer_setup(idx: int, run_id: str) -> None:
        pass

    master.register_creation_hook(optimizer_setup)  # registered on rank 0 only
    new_run(tmp_path, "run_a")
    master.discover_runs()
    errors = run_ranks(master.synchronize_state, other.synchronize_state)
    for rank, error in enumerate(errors):
        assert isinstance(error, HookMismatchError), (rank, error)
        assert "optimizer_setup" in str(error) and "rank 1" in str(error)


def test_rank1_times_out_with_a_clear_error_if_rank0_never_syncs(tmp_path: Path) -> None:
    _, other = pair(tmp_path, timeout_s=0.3)
    with pytest.raises(WaitTimeoutError, match=r"rank 1: waited .* snapshot version 0"):
        other.synchronize_state()


def test_resume_decision_is_rank0s_even_if_rank1_sees_other_files(tmp_path: Path) -> None:
    import torch

    store = dist.HashStore()
    kwargs: dict[str, Any] = {"store": store, "world_size": 2, "sync_timeout_s": 10.0}
    shared, stale_view = tmp_path / "shared", tmp_path / "stale"
    shared.mkdir()
    stale_view.mkdir()
    new_run(shared, "run_a")
    first = MultiRunManager(shared, 2)
    first.discover_runs()
    first.record_progress(0, tokens=30, samples=3)
    first.save_run_checkpoint(0, 4, {"w": torch.ones(1)}, {}, {})
    # Rank 1's view of the disk (a lagging network filesystem, say) has no checkpoint at all.
    master = MultiRunManager(shared, 2, rank=0, **kwargs)
    other = MultiRunManager(stale_view, 2, rank=1, **kwargs)
    master.discover_runs()
    assert run_ranks(master.synchronize_state, other.synchronize_state) == [None, None]
    assert other.latest_stable_checkpoint("run_a") is None
    assert master.resume_step(0) == other.resume_step(0) == 4
    assert other.progress[0].total_tokens == 30
