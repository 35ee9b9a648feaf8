"""The seed's seven steps of discover_runs(), and evict_run(), on the master at world size 1."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from mr_helpers import StandInLora, make_config, new_run

from rlplex.errors import MultiRunError, RunDirGoneError
from rlplex.multirun import (
    EMPTY_SLOT_SCALING,
    MultiRunManager,
    OrchestratorConfig,
    RunDir,
    get_multi_run_manager,
    setup_multi_run_manager,
)
from rlplex.multirun.rundir import write_finished
from rlplex.multirun.trainer import manager as manager_module


def manager(tmp_path: Path, max_runs: int = 4) -> MultiRunManager:
    return setup_multi_run_manager(tmp_path, max_runs)


def test_get_before_setup_raises_and_setup_replaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manager_module, "_MANAGER", None)
    with pytest.raises(MultiRunError, match="setup_multi_run_manager"):
        get_multi_run_manager()
    first = setup_multi_run_manager(tmp_path, 2)
    assert get_multi_run_manager() is first
    second = setup_multi_run_manager(tmp_path, 3)
    assert get_multi_run_manager() is second and second.max_runs == 3


def test_step1_scan_and_step6_mappings(tmp_path: Path) -> None:
    mrm = manager(tmp_path)
    for name in ("run_b", "run_a", "run_c"):
        new_run(tmp_path, name)
    (tmp_path / "not_a_run").mkdir()
    mrm.discover_runs()
    assert mrm.idx_2_id == {0: "run_a", 1: "run_b", 2: "run_c"}
    assert mrm.id_2_idx == {"run_a": 0, "run_b": 1, "run_c": 2}
    assert mrm.run_statuses() == {"run_a": "active", "run_b": "active", "run_c": "active"}
    assert mrm.config[1].env.name == "reverse"
    assert mrm.progress[2].step == 0


def test_step1_symlinks_files_and_bad_names_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    new_run(outside, "run_real")
    out = tmp_path / "out"
    out.mkdir()
    (out / "run_link").symlink_to(outside / "run_real")
    (out / "run_file").write_text("x")
    (out / "run_bad name").mkdir()
    new_run(out, "run_ok")
    mrm = manager(out)
    mrm.discover_runs()
    assert mrm.idx_2_id == {0: "run_ok"}
    warned = caplog.text
    assert "run_link" in warned and "symlink" in warned
    assert "run_file" in warned and "not a directory" in warned
    assert "run_bad name" in warned
    caplog.clear()
    mrm.discover_runs()
    assert "run_link" not in caplog.text  # warned once, not at every scan
    shutil.rmtree(outside)


def test_step2_evicted_runs_skipped(tmp_path: Path) -> None:
    new_run(tmp_path, "run_a")
    run_b = new_run(tmp_path, "run_b")
    run_b.write_text(run_b.evicted, "bad rewards")
    mrm = manager(tmp_path)
    mrm.discover_runs()
    assert mrm.idx_2_id == {0: "run_a"}
    assert mrm.run_statuses()["run_b"] == "evicted"
    assert mrm.status_reason("run_b") == "bad rewards"


def test_steps_3_4_7_hooks_for_new_and_deleted_runs(tmp_path: Path) -> None:
    mrm = manager(tmp_path)
    calls: list[tuple] = []
    mrm.register_discovered_hook(lambda idx, run_id, config: calls.append(("discovered", idx, run_id, config.env.name)))
    mrm.register_forgotten_hook(lambda idx, run_id: calls.append(("forgotten", idx, run_id)))
    new_run(tmp_path, "run_a")
    run_b = new_run(tmp_path, "run_b", env={"name": "sort"})
    mrm.discover_runs()
    assert calls == [("discovered", 0, "run_a", "reverse"), ("discovered", 1, "run_b", "sort")]
    calls.clear()
    mrm.discover_runs()
    assert calls == []  # no change, no hook
    shutil.rmtree(run_b.root)
    new_run(tmp_path, "run_c")
    mrm.discover_runs()
    # Forgotten before discovered, and the freed slot 1 is reused.
    assert calls == [("forgotten", 1, "run_b"), ("discovered", 1, "run_c", "reverse")]
    assert mrm.idx_2_id == {0: "run_a", 1: "run_c"}
    assert "run_b" not in mrm.run_statuses()


def test_step5_invalid_configs_rejected_with_error_file_others_fine(tmp_path: Path) -> None:
    bodies: dict[str, bytes] = {
        "run_badtoml": b"task = = 3\n",
        "run_types": b'task = "t"\nmax_steps = 3\nbatch_size = 2\n[model.lora]\nrank = "eight"\n',
        "run_huge": b"#" * 1_000_001,
        "run_binary": b"\xff\xfe\x00",
    }
    for name, body in bodies.items():
        control = tmp_path / name / "control"
        control.mkdir(parents=True)
        (control / "orch.toml").write_bytes(body)
    (tmp_path / "run_dir/control/orch.toml").mkdir(parents=True)
    new_run(tmp_path, "run_good")
    mrm = manager(tmp_path)
    mrm.discover_runs()
    assert mrm.idx_2_id == {0: "run_good"}
    statuses = mrm.run_statuses()
    expected = {
        "run_badtoml": "not valid TOML",
        "run_types": "model.lora.rank",
        "run_huge": "more than the limit",
        "run_binary": "not UTF-8",
        "run_dir": "not a regular file",
    }
    for name, reason in expected.items():
        assert statuses[name] == "rejected"
        error_file = RunDir(tmp_path, name).config_error
        assert reason in error_file.read_text(), name
        assert reason in (mrm.status_reason(name) or "")


def test_step5_rejected_run_is_judged_again_when_its_config_changes(tmp_path: Path) -> None:
    run = RunDir(tmp_path, "run_a")
    run.control.mkdir(parents=True)
    run.orch_config.write_text("task = 1\n")
    mrm = manager(tmp_path)
    mrm.discover_runs()
    assert mrm.run_statuses() == {"run_a": "rejected"}
    new_run(tmp_path, "run_a")  # rewritten atomically: new inode
    mrm.discover_runs()
    assert mrm.run_statuses() == {"run_a": "active"}
    assert not run.config_error.exists()


def test_step5_missing_config_is_pending_then_picked_up(tmp_path: Path) -> None:
    (tmp_path / "run_a").mkdir()
    mrm = manager(tmp_path)
    mrm.discover_runs()
    assert mrm.run_statuses() == {"run_a": "pending"}
    assert not RunDir(tmp_path, "run_a").config_error.exists()
    new_run(tmp_path, "run_a")
    mrm.discover_runs()
    assert mrm.idx_2_id == {0: "run_a"}


def test_step5_config_validation_hooks(tmp_path: Path) -> None:
    mrm = manager(tmp_path)

    def small_batches(config: OrchestratorConfig) -> tuple[bool, str]:
        return (config.batch_size <= 8, f"batch_size {config.batch_size} > 8")

    def broken(config: OrchestratorConfig) -> tuple[bool, str]:
        if config.env.name == "explode":
            raise ValueError("boom")
        return True, ""

    mrm.register_config_validation_hook(small_batches)
    mrm.register_config_validation_hook(broken)
    new_run(tmp_path, "run_big", batch_size=64)
    new_run(tmp_path, "run_boom", env={"name": "explode"})
    new_run(tmp_path, "run_ok")
    mrm.discover_runs()
    assert mrm.idx_2_id == {0: "run_ok"}
    assert "batch_size 64 > 8" in RunDir(tmp_path, "run_big").config_error.read_text()
    assert "ValueError: boom" in RunDir(tmp_path, "run_boom").config_error.read_text()


def test_step5_rank_above_the_trainers_maximum_rejected(tmp_path: Path) -> None:
    mrm = manager(tmp_path, max_runs=2)
    mrm.register_lora_module("layer", StandInLora(2, rank=8))
    new_run(tmp_path, "run_a", model={"lora": {"rank": 16, "alpha": 32.0}})
    mrm.discover_runs()
    assert mrm.run_statuses() == {"run_a": "rejected"}
    assert "maximum LoRA rank 8" in RunDir(tmp_path, "run_a").config_error.read_text()


def test_step7_default_discovered_hook_sets_scaling_and_ranks(tmp_path: Path) -> None:
    mrm = manager(tmp_path, max_runs=3)
    new_run(tmp_path, "run_a", model={"lora": {"rank": 4, "alpha": 16.0}})
    new_run(tmp_path, "run_b", model={"lora": {"rank": 8, "alpha": 8.0}})
    mrm.discover_runs()
    assert mrm.scaling_factors.tolist() == [4.0, 1.0, EMPTY_SLOT_SCALING]
    assert mrm.lora_ranks.tolist() == [4, 8, 0]
    shutil.rmtree(tmp_path / "run_a")
    mrm.discover_runs()
    assert mrm.scaling_factors[0].item() == EMPTY_SLOT_SCALING and mrm.lora_ranks[0].item() == 0


def test_waiting_runs_admitted_in_arrival_order_when_a_slot_frees(tmp_path: Path) -> None:
    mrm = manager(tmp_path, max_runs=2)
    new_run(tmp_path, "run_a")
    new_run(tmp_path, "run_b")
    mrm.discover_runs()
    new_run(tmp_path, "run_z")
    mrm.discover_runs()
    new_run(tmp_path, "run_c")
    mrm.discover_runs()
    assert mrm.run_statuses() == {"run_a": "active", "run_b": "active", "run_c": "waiting", "run_z": "waiting"}
    shutil.rmtree(tmp_path / "run_a")
    mrm.discover_runs()
    assert mrm.idx_2_id == {0: "run_z", 1: "run_b"}  # run_z arrived first
    assert mrm.run_statuses()["run_c"] == "waiting"


def test_waiting_run_rewritten_with_a_bad_config_is_rejected_at_admission(tmp_path: Path) -> None:
    mrm = manager(tmp_path, max_runs=1)
    new_run(tmp_path, "run_a")
    run_b = new_run(tmp_path, "run_b")
    mrm.discover_runs()
    run_b.write_text(run_b.orch_config, "max_steps = 0\n")
    shutil.rmtree(tmp_path / "run_a")
    mrm.discover_runs()
    assert mrm.idx_2_id == {}
    assert mrm.run_statuses() == {"run_b": "rejected"}


def test_run_deleted_while_active_is_forgotten_and_never_recreated(tmp_path: Path) -> None:
    mrm = manager(tmp_path, max_runs=1)
    forgotten: list[str] = []
    mrm.register_forgotten_hook(lambda idx, run_id: forgotten.append(run_id))
    run = new_run(tmp_path, "run_a")
    mrm.discover_runs()
    adapter = {"w": torch.ones(2)}
    mrm.save_run_checkpoint(0, 1, adapter, {}, {})
    shutil.rmtree(run.root)
    with pytest.raises(RunDirGoneError):  # a late write before the next scan
        mrm.save_run_checkpoint(0, 2, adapter, {}, {}, run_id="run_a")
    assert not run.root.exists()
    mrm.discover_runs()
    assert forgotten == ["run_a"] and mrm.idx_2_id == {}
    new_run(tmp_path, "run_b")
    mrm.discover_runs()
    # The slot now belongs to run_b: a stale write for run_a is refused, run_b's directory untouched.
    with pytest.raises(MultiRunError, match="now holds run_b"):
        mrm.save_run_checkpoint(0, 2, adapter, {}, {}, run_id="run_a")
    assert not run.root.exists()
    assert not RunDir(tmp_path, "run_b").checkpoints.exists()


def test_evict_run_steps(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mrm = manager(tmp_path)
    calls: list[tuple] = []
    mrm.register_forgotten_hook(lambda idx, run_id: calls.append(("forgotten", idx, run_id)))
    run_a = new_run(tmp_path, "run_a")
    new_run(tmp_path, "run_b")
    mrm.discover_runs()
    with caplog.at_level(logging.WARNING):
        mrm.evict_run(0, "NaN rewards in rollouts/step_3")
    # 1. reason written; 2. warning logged; 3. not removed yet.
    assert run_a.evicted.read_text().strip() == "NaN rewards in rollouts/step_3"
    assert "run_a" in caplog.text and "NaN rewards" in caplog.text
    assert mrm.idx_2_id == {0: "run_a", 1: "run_b"}
    assert calls == []
    mrm.discover_runs()
    assert calls == [("forgotten", 0, "run_a")]
    assert mrm.idx_2_id == {1: "run_b"}
    assert mrm.run_statuses() == {"run_a": "evicted", "run_b": "active"}
    new_run(tmp_path, "run_c")
    mrm.discover_runs()
    assert mrm.id_2_idx["run_c"] == 0  # the index went back to the free pool
    with pytest.raises(MultiRunError, match="holds no run"):
        mrm.evict_run(3, "nothing there")


def test_evicted_run_comes_back_when_evicted_txt_is_removed(tmp_path: Path) -> None:
    mrm = manager(tmp_path)
    run = new_run(tmp_path, "run_a")
    mrm.discover_runs()
    mrm.evict_run(0, "manual")
    mrm.discover_runs()
    os.unlink(run.evicted)
    mrm.discover_runs()
    assert mrm.run_statuses() == {"run_a": "active"}


def test_finished_run_leaves_its_slot_to_a_waiting_run_and_keeps_its_files(tmp_path: Path) -> None:
    mrm = manager(tmp_path, max_runs=1)
    calls: list[str] = []
    mrm.register_forgotten_hook(lambda idx, run_id: calls.append(f"forgotten {idx} {run_id}"))
    mrm.register_discovered_hook(lambda idx, run_id, config: calls.append(f"discovered {idx} {run_id}"))
    mrm.register_deletion_hook(lambda idx, run_id: calls.append(f"deletion {idx} {run_id}"))
    mrm.register_creation_hook(lambda idx, run_id: calls.append(f"creation {idx} {run_id}"))
    run_a = new_run(tmp_path, "run_a", max_steps=2)
    new_run(tmp_path, "run_b")
    mrm.discover_runs()
    mrm.synchronize_state()
    assert mrm.run_statuses() == {"run_a": "active", "run_b": "waiting"}
    mrm.record_progress(0, tokens=5, samples=1)
    mrm.record_progress(0, tokens=5, samples=1)
    checkpoint = mrm.save_run_checkpoint(0, 2, {"w": torch.ones(1)}, {}, {})
    calls.clear()
    write_finished(run_a, 2)
    mrm.discover_runs()
    mrm.synchronize_state()
    # Like an eviction: forgotten, slot 0 freed and given to the waiting run, deletion before creation.
    assert calls == ["forgotten 0 run_a", "discovered 0 run_b", "deletion 0 run_a", "creation 0 run_b"]
    assert mrm.idx_2_id == {0: "run_b"} and mrm.progress[0].step == 0
    assert mrm.run_statuses() == {"run_a": "finished", "run_b": "active"}
    assert mrm.status_reason("run_a") == "finished: trained 2 steps"
    assert run_a.orch_config.is_file() and (checkpoint / "STABLE").is_file()  # files kept
    calls.clear()
    mrm.discover_runs()
    mrm.synchronize_state()
    assert calls == [] and mrm.run_statuses()["run_a"] == "finished"
    # A restarted trainer (a fresh manager with a free slot) does not admit it again.
    restarted = setup_multi_run_manager(tmp_path, 2)
    restarted.discover_runs()
    assert restarted.idx_2_id == {0: "run_b"}
    assert restarted.run_statuses() == {"run_a": "finished", "run_b": "active"}


def test_finished_marker_read_by_the_scan_evicted_wins_and_removal_readmits(tmp_path: Path) -> None:
    run_a = new_run(tmp_path, "run_a")
    run_b = new_run(tmp_path, "run_b")
    write_finished(run_a, 3)
    record = json.loads(run_a.finished.read_text())
    assert record["step"] == 3 and record["time"] > 0 and run_a.finished_step() == 3
    write_finished(run_b, 1)
    run_b.write_text(run_b.evicted, "bad rewards")  # both files: the eviction is what is reported
    mrm = manager(tmp_path)
    mrm.discover_runs()
    assert mrm.idx_2_id == {}
    assert mrm.run_statuses() == {"run_a": "finished", "run_b": "evicted"}
    assert mrm.status_reason("run_b") == "bad rewards"
    run_a.finished.write_text("not json")
    mrm.discover_runs()
    assert mrm.run_statuses()["run_a"] == "finished"  # the file, not its content, closes the run
    assert run_a.finished_step() is None
    os.unlink(run_a.finished)  # an operator removed it: the run is judged anew
    mrm.discover_runs()
    assert mrm.run_statuses()["run_a"] == "active"


def test_master_only_methods_refused_on_other_ranks(tmp_path: Path) -> None:
    mrm = MultiRunManager(tmp_path, 2, rank=1, world_size=2)
    with pytest.raises(MultiRunError, match="master rank only"):
        mrm.discover_runs()
    with pytest.raises(MultiRunError, match="master rank only"):
        mrm.evict_run(0, "x")


def test_resume_decided_at_discovery_from_the_latest_stable_checkpoint(tmp_path: Path) -> None:
    mrm = manager(tmp_path, max_runs=2)
    new_run(tmp_path, "run_a")
    mrm.discover_runs()
    mrm.record_progress(0, tokens=100, samples=4)
    mrm.save_run_checkpoint(0, 1, {"w": torch.ones(1)}, {}, {})
    mrm.record_progress(0, tokens=50, samples=4)
    mrm.save_run_checkpoint(0, 2, {"w": torch.ones(1)}, {}, {})
    fresh = setup_multi_run_manager(tmp_path, 2)
    new_run(tmp_path, "run_b")
    fresh.discover_runs()
    a = fresh.id_2_idx["run_a"]
    assert fresh.resume_step(a) == 2
    assert fresh.resume_checkpoint_path(a) == RunDir(tmp_path, "run_a").checkpoint_step(2)
    assert (fresh.progress[a].step, fresh.progress[a].total_tokens, fresh.progress[a].total_samples) == (2, 150, 8)
    assert fresh.resume_step(fresh.id_2_idx["run_b"]) is None
    assert fresh.latest_stable_checkpoint("run_a") == RunDir(tmp_path, "run_a").checkpoint_step(2)


def test_lora_modules_parameters_state_dict_reset_and_active_adapters(tmp_path: Path) -> None:
    mrm = manager(tmp_path, max_runs=2)
    layer = StandInLora(2, rank=4)
    mrm.register_lora_module("model.layers.0.q_proj", layer)
    with pytest.raises(MultiRunError, match="already registered"):
        mrm.register_lora_module("model.layers.0.q_proj", layer)
    names = [name for name, _ in mrm.get_named_parameters_for_run(1)]
    assert names == ["model.layers.0.q_proj.lora_A.weight", "model.layers.0.q_proj.lora_B.weight"]
    mrm.reset_run_parameters(1)
    state = mrm.get_state_dict_for_run(1)
    assert torch.count_nonzero(state["model.layers.0.q_proj.lora_B.weight"]) == 0
    assert torch.count_nonzero(state["model.layers.0.q_proj.lora_A.weight"]) > 0
    assert torch.count_nonzero(layer.lora_B[0]) == layer.lora_B[0].numel()  # slot 0 untouched
    new_run(tmp_path, "run_a", model={"lora": {"rank": 4, "alpha": 8.0}})
    mrm.discover_runs()
    with mrm.active_adapters(torch.tensor([0, 0])) as batch:
        assert mrm.adapter_ids is batch.ids
    assert mrm.adapter_ids is None
    with pytest.raises(MultiRunError, match=r"adapter ids \[1\] name no active run"):
        with mrm.active_adapters(torch.tensor([0, 1])):
            pass


def test_config_of_every_active_run_matches_its_file(tmp_path: Path) -> None:
    mrm = manager(tmp_path)
    new_run(tmp_path, "run_a", optim={"lr": 0.5, "max_grad_norm": 2.0}, seed=7)
    mrm.discover_runs()
    assert mrm.config[0] == make_config(optim={"lr": 0.5, "max_grad_norm": 2.0}, seed=7)


def test_run_dir_deleted_and_made_again_under_the_same_name_is_a_new_run(tmp_path: Path) -> None:
    mrm = manager(tmp_path, max_runs=2)
    calls: list[str] = []
    mrm.register_forgotten_hook(lambda idx, run_id: calls.append(f"forgotten {run_id}"))
    mrm.register_discovered_hook(lambda idx, run_id, config: calls.append(f"discovered {run_id} {config.seed}"))
    run = new_run(tmp_path, "run_a", seed=1)
    mrm.discover_runs()
    keep = tmp_path / "keep"  # hold the old inode so the filesystem cannot hand it out again
    run.root.rename(keep)
    new_run(tmp_path, "run_a", seed=2)
    mrm.discover_runs()
    assert calls == ["discovered run_a 1", "forgotten run_a", "discovered run_a 2"]
    assert mrm.config[mrm.id_2_idx["run_a"]].seed == 2
