"""Links planted in a run's folder must not redirect the orchestrator's writes or reads (issue 31, hole 5).

Each test plants one link, runs the real code that writes progress or picks and loads the
broadcast, and checks that nothing outside the run changed (every file's bytes and mtime, no
new file) and that the run never takes another run's adapter. The whole orchestrator process
with two of these links is in `test_orchestrator.py`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from mr_helpers import make_config, new_run, snapshot

from rlplex.diagnostics import MetricsLogger
from rlplex.diagnostics.metrics import read_metrics_csv
from rlplex.errors import AdapterError, MultiRunError, UnsafeFileError
from rlplex.inference.engine import Completion, SamplingParams
from rlplex.io.safe_files import append_regular_file, write_file_atomic
from rlplex.multirun import RunDir, create_run, write_peft_adapter
from rlplex.multirun.orchestrator.loop import WaitOptions, latest_stable_broadcast, run_orchestrator
from rlplex.multirun.orchestrator.models import ActorModel
from rlplex.multirun.orchestrator.policy import read_peft_adapter
from rlplex.multirun.rundir.peft_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_stable_adapter
from rlplex.tasks import load_environment
from timing import scaled

RANK = 2


def adapter_state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "layer.q_proj.lora_A.weight": torch.randn(RANK, 3, generator=generator),
        "layer.q_proj.lora_B.weight": torch.randn(4, RANK, generator=generator),
    }


def broadcast(run: RunDir, step: int, seed: int) -> Path:
    run.ensure_dir("broadcast")
    return write_peft_adapter(run.broadcast_step(step), adapter_state(seed), "base", RANK, 4.0, ["q_proj"])


@pytest.fixture
def out(tmp_path: Path) -> Path:
    folder = tmp_path / "out"
    folder.mkdir()
    return folder


@pytest.fixture
def other_run(out: Path) -> RunDir:
    """run_b: adapters up to step 8 and a 24-line progress.csv, all of which must stay as they are."""
    run = new_run(out, "run_b")
    for step in (0, 8):
        broadcast(run, step, seed=100 + step)
    with MetricsLogger(run.root, tensorboard=False) as metrics:
        for step in range(23):
            metrics.log(step, {"charts/reward_mean": step / 23})
    assert len((run.root / "progress.csv").read_text().splitlines()) == 24
    return run


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder outside the output folder, with a file in it."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "notes.csv").write_text("step,charts/x\n0,1.0\n")
    return folder


def in_process_orchestrator(out: Path, run_id: str, tensorboard: bool) -> None:
    # No broadcast is ever written: the orchestrator must fail before it waits for one.
    run_orchestrator(out, run_id, make_config(), WaitOptions(timeout_s=scaled(5.0)), tensorboard)


# ---- progress.csv and tb: links to a file or a folder outside the output folder -------------------
@pytest.mark.parametrize(
    ("name", "message"),
    [("progress.csv", "is a symlink"), ("tb", "is a symlink; rlplex writes nothing")],
    ids=["progress.csv", "tb"],
)
def test_a_link_planted_before_the_start_fails_the_orchestrator_naming_it_and_nothing_outside_changes(
    out: Path, outside: Path, name: str, message: str
) -> None:
    run = new_run(out, "run_a")
    if name == "tb":
        (run.root / name).symlink_to(outside, target_is_directory=True)
    else:
        (run.root / name).symlink_to(outside / "notes.csv")
    before = snapshot(outside)
    with pytest.raises(UnsafeFileError, match=re.escape(f"{run.root / name}: {message}")):
        in_process_orchestrator(out, "run_a", tensorboard=name == "tb")
    assert snapshot(outside) == before


def test_a_progress_csv_link_planted_mid_run_is_not_appended_to(out: Path, outside: Path) -> None:
    run = new_run(out, "run_a")
    with MetricsLogger(run.root, tensorboard=False) as metrics:
        metrics.log(0, {"charts/reward_mean": 0.5})
        (run.root / "progress.csv").unlink()
        (run.root / "progress.csv").symlink_to(outside / "notes.csv")
        before = snapshot(outside)
        with pytest.raises(UnsafeFileError, match=re.escape("progress.csv: is a symlink; nothing written through it")):
            metrics.log(1, {"charts/reward_mean": 0.6})
    assert snapshot(outside) == before


@pytest.mark.parametrize("kind", ["symlink", "hard link", "fifo"])
def test_an_append_goes_only_to_a_regular_file_of_its_own(tmp_path: Path, outside: Path, kind: str) -> None:
    path = tmp_path / "log.csv"
    if kind == "symlink":
        path.symlink_to(outside / "notes.csv")
    elif kind == "hard link":
        os.link(outside / "notes.csv", path)
    else:
        os.mkfifo(path)
    before = snapshot(outside)
    with pytest.raises(UnsafeFileError, match=re.escape(str(path))):
        append_regular_file(path, b"1,2.0\n")
    assert snapshot(outside) == before


# ---- progress.csv.tmp: a link to another run's progress.csv ---------------------------------------
def test_a_progress_csv_tmp_link_to_another_runs_progress_is_never_written_through(
    out: Path, other_run: RunDir
) -> None:
    run = new_run(out, "run_a")
    target = other_run.root / "progress.csv"
    (run.root / "progress.csv.tmp").symlink_to(target)  # the name the rewrite used to write
    # The name it writes now, planted as a link and as a hard link: removed, never written through.
    (run.root / f".progress.csv.tmp-{os.getpid()}").symlink_to(target)
    before = snapshot(other_run.root)
    with MetricsLogger(run.root, tensorboard=False) as metrics:
        metrics.log(0, {"charts/reward_mean": 0.5})  # the first row writes the file whole
        os.link(target, run.root / f".progress.csv.tmp-{os.getpid()}")
        metrics.log(1, {"charts/reward_mean": 0.6, "charts/new_column": 1.0})  # a wider header: rewritten
    assert snapshot(other_run.root) == before
    assert [row["step"] for row in read_metrics_csv(run.root / "progress.csv")] == [0.0, 1.0]
    assert not (run.root / "progress.csv").is_symlink()


def test_an_atomic_write_never_writes_through_its_temporary_name(tmp_path: Path, outside: Path) -> None:
    path = tmp_path / "record.json"
    (tmp_path / f".record.json.tmp-{os.getpid()}").symlink_to(outside / "notes.csv")
    before = snapshot(outside)
    write_file_atomic(path, b"{}")
    os.link(outside / "notes.csv", tmp_path / f".record.json.tmp-{os.getpid()}")
    write_file_atomic(path, b"{1}")
    assert snapshot(outside) == before and path.read_bytes() == b"{1}"


# ---- tb: an evaluation's link to a folder outside --------------------------------------------
def test_an_evaluation_tb_link_is_refused_too(out: Path, outside: Path) -> None:
    run = new_run(out, "run_a")
    (run.evaluations).mkdir()
    (run.evaluations / "tb").symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)
    with pytest.raises(UnsafeFileError, match="tb: is a symlink"):
        MetricsLogger(run.ensure_dir(run.evaluations.name), tensorboard=True)
    assert snapshot(outside) == before


def test_a_run_folder_that_is_a_link_is_refused_by_the_orchestrator(out: Path, outside: Path) -> None:
    (out / "run_a").symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)
    with pytest.raises(MultiRunError, match="it is a symlink"):
        create_run(out, "run_a", make_config())
    assert snapshot(outside) == before


# ---- broadcast/step_N: a link to another run's newest adapter -------------------------------------
def test_a_linked_broadcast_step_is_never_chosen(out: Path, other_run: RunDir) -> None:
    run = new_run(out, "run_a")
    for step in (0, 1):
        broadcast(run, step, seed=step)
    (run.broadcast / "step_9").symlink_to(other_run.broadcast_step(8), target_is_directory=True)
    assert latest_stable_broadcast(run) == 1
    assert not is_stable_adapter(run.broadcast / "step_9", within=run.root)


def test_a_broadcast_step_whose_weights_link_out_is_never_chosen(out: Path, other_run: RunDir) -> None:
    run = new_run(out, "run_a")
    broadcast(run, 0, seed=0)
    own = broadcast(run, 3, seed=3)
    (own / ADAPTER_WEIGHTS).unlink()
    (own / ADAPTER_WEIGHTS).symlink_to(other_run.broadcast_step(8) / ADAPTER_WEIGHTS)
    assert latest_stable_broadcast(run) == 0


def test_a_broadcast_folder_linked_to_another_runs_is_never_read(out: Path, other_run: RunDir) -> None:
    run = new_run(out, "run_a")
    run.broadcast.symlink_to(other_run.broadcast, target_is_directory=True)
    assert latest_stable_broadcast(run) is None


class RecordingEngine:
    """An engine that only records which folders it was asked to load."""

    def __init__(self) -> None:
        self.loaded: list[Path] = []

    def load_adapter(self, name: str, path: Path) -> float:
        self.loaded.append(Path(path))
        return 0.0

    def unload_adapter(self, name: str) -> None:
        pass

    def generate(self, adapter: str, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        return []

    def close(self) -> None:
        pass


def test_a_broadcast_step_swapped_for_a_link_after_it_was_chosen_never_reaches_the_engine(
    out: Path, other_run: RunDir
) -> None:
    run = new_run(out, "run_a")
    config = make_config()
    broadcast(run, 0, seed=0)
    engine = RecordingEngine()
    actor = ActorModel(engine, None, run, config, load_environment(config.env), stop_ids=())  # type: ignore[arg-type]
    actor.complete(0, [], temperature=1.0, seed=0, max_new_tokens=4)
    assert engine.loaded == [run.broadcast_step(0)] and actor.loaded_step == 0
    (run.broadcast / "step_1").symlink_to(other_run.broadcast_step(8), target_is_directory=True)
    with pytest.raises(AdapterError, match=re.escape(f"{run.broadcast_step(1)}: not loaded: is a symlink")):
        actor.complete(1, [], temperature=1.0, seed=0, max_new_tokens=4)
    assert engine.loaded == [run.broadcast_step(0)] and actor.loaded_step == 0
    assert not run.is_evicted()  # not the engine refusing an adapter: the run is not evicted for it


@pytest.mark.parametrize("name", [ADAPTER_WEIGHTS, ADAPTER_CONFIG])
def test_the_in_process_engine_reads_no_adapter_file_through_a_link(out: Path, other_run: RunDir, name: str) -> None:
    run = new_run(out, "run_a")
    own = broadcast(run, 0, seed=0)
    (own / name).unlink()
    (own / name).symlink_to(other_run.broadcast_step(8) / name)
    with pytest.raises(AdapterError, match=re.escape(str(own / name)) + ".*symlink"):
        read_peft_adapter(own)


def test_the_trainer_replaces_a_linked_broadcast_step_with_its_own_and_leaves_the_target_alone(
    out: Path, other_run: RunDir
) -> None:
    run = new_run(out, "run_a")
    run.ensure_dir("broadcast")
    (run.broadcast / "step_0").symlink_to(other_run.broadcast_step(8), target_is_directory=True)
    before = snapshot(other_run.root)
    broadcast(run, 0, seed=0)  # what the trainer does when step 0 is not a stable adapter of the run
    assert snapshot(other_run.root) == before
    assert is_stable_adapter(run.broadcast_step(0), within=run.root)
    assert sorted(os.listdir(run.broadcast)) == ["step_0"]  # the link moved aside is gone, not left over
