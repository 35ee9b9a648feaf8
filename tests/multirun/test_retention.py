from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlplex.config import validate_config
from rlplex.errors import ConfigError
from rlplex.multirun.rundir import STABLE_MARKER, RunDir, retention, stable_steps, step_dir_name
from rlplex.multirun.rundir.retention import (
    KeepPolicy,
    RetentionConfig,
    prune_steps,
    remove_orphaned_temporaries,
    steps_to_keep,
)


@pytest.fixture
def run(tmp_path: Path) -> RunDir:
    run = RunDir(tmp_path / "out", "run_a")
    run.root.mkdir(parents=True)
    for kind in ("checkpoints", "broadcast", "rollouts", "control"):
        run.ensure_dir(kind)
    return run


def make_step(parent: Path, step: int, *, stable: bool = True) -> Path:
    """A step folder as a writer leaves it: a payload, then (if finished) the marker."""
    path = parent / step_dir_name(step)
    path.mkdir()
    (path / "payload.bin").write_bytes(b"x" * 16)
    if stable:
        (path / STABLE_MARKER).write_bytes(b"")
    return path


def steps_on_disk(parent: Path) -> list[str]:
    return sorted(os.listdir(parent))


def names(*steps: int) -> list[str]:
    return sorted(step_dir_name(step) for step in steps)


# ---- config ----------------------------------------------------------------------------------


def test_defaults() -> None:
    config = RetentionConfig()
    assert config.checkpoints == KeepPolicy(keep_last=3)
    assert config.broadcast == KeepPolicy(keep_last=8)
    assert config.rollouts == KeepPolicy(keep_last=8)
    assert KeepPolicy() == KeepPolicy(keep_last=None, keep_every=None)


@pytest.mark.parametrize("field", ["keep_last", "keep_every"])
def test_zero_is_rejected_naming_the_field(field: str) -> None:
    with pytest.raises(ConfigError, match=rf"field 'checkpoints\.{field}'.*greater than or equal to 1"):
        validate_config(RetentionConfig, {"checkpoints": {field: 0}}, "trainer.toml")
    with pytest.raises(ValidationError, match=field):
        KeepPolicy.model_validate({field: 0})


def test_unknown_field_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"rollouts\.keep_first"):
        validate_config(RetentionConfig, {"rollouts": {"keep_first": 2}})


def test_steps_to_keep() -> None:
    assert steps_to_keep([], KeepPolicy(keep_last=1)) == set()
    assert steps_to_keep([5, 1, 3], KeepPolicy()) == {1, 3, 5}
    assert steps_to_keep(range(10), KeepPolicy(keep_last=2, keep_every=4)) == {0, 4, 8, 9}


# ---- prune_steps -----------------------------------------------------------------------------


def test_keep_last(run: RunDir) -> None:
    for step in range(6):
        make_step(run.checkpoints, step)
    assert prune_steps(run.checkpoints, KeepPolicy(keep_last=2)) == [0, 1, 2, 3]
    assert steps_on_disk(run.checkpoints) == names(4, 5)
    assert [step for step, _ in stable_steps(run.checkpoints)] == [4, 5]


def test_keep_every(run: RunDir) -> None:
    for step in range(8):
        make_step(run.broadcast, step)
    assert prune_steps(run.broadcast, KeepPolicy(keep_last=1, keep_every=3)) == [1, 2, 4, 5]
    assert steps_on_disk(run.broadcast) == names(0, 3, 6, 7)


def test_keep_all_removes_nothing_stable(run: RunDir) -> None:
    for step in range(4):
        make_step(run.broadcast, step)
    assert prune_steps(run.broadcast, KeepPolicy(keep_every=2)) == []
    assert steps_on_disk(run.broadcast) == names(0, 1, 2, 3)


def test_protect(run: RunDir) -> None:
    for step in range(5):
        make_step(run.checkpoints, step)
    assert prune_steps(run.checkpoints, KeepPolicy(keep_last=1), protect={1, 3}) == [0, 2]
    assert steps_on_disk(run.checkpoints) == names(1, 3, 4)


def test_below_spares_unconsumed_rollouts(run: RunDir) -> None:
    for step in range(6):
        make_step(run.rollouts, step, stable=step != 4)
    # Step 4 is unmarked and older than the newest stable step, but not consumed yet.
    assert prune_steps(run.rollouts, KeepPolicy(keep_last=1), below=3) == [0, 1, 2]
    assert steps_on_disk(run.rollouts) == names(3, 4, 5)


def test_keep_last_counts_stable_steps_not_writes_in_progress(run: RunDir) -> None:
    for step in range(4):
        make_step(run.checkpoints, step)
    make_step(run.checkpoints, 4, stable=False)
    make_step(run.checkpoints, 5, stable=False)
    # The newest stable step (3) is the one a resume reads: two newer unmarked folders must not
    # push it out of keep_last, and being newer they are writes in progress, kept too.
    assert prune_steps(run.checkpoints, KeepPolicy(keep_last=1)) == [0, 1, 2]
    assert steps_on_disk(run.checkpoints) == names(3, 4, 5)


def test_newest_stable_survives_even_below_nothing_kept(run: RunDir) -> None:
    make_step(run.broadcast, 7)
    assert prune_steps(run.broadcast, KeepPolicy(keep_last=1), below=100) == []
    assert steps_on_disk(run.broadcast) == names(7)


def test_unmarked_leftovers_removed(run: RunDir) -> None:
    for step in (1, 2, 4):
        make_step(run.checkpoints, step)
    for step in (0, 3, 5):
        make_step(run.checkpoints, step, stable=False)
    assert prune_steps(run.checkpoints, KeepPolicy()) == [0, 3]
    assert steps_on_disk(run.checkpoints) == names(1, 2, 4, 5)


def test_no_stable_step_removes_nothing(run: RunDir) -> None:
    for step in range(3):
        make_step(run.checkpoints, step, stable=False)
    assert prune_steps(run.checkpoints, KeepPolicy(keep_last=1)) == []
    assert steps_on_disk(run.checkpoints) == names(0, 1, 2)


def test_only_protocol_names_are_touched(run: RunDir) -> None:
    for step in range(3):
        make_step(run.checkpoints, step)
    (run.checkpoints / "step_0x").mkdir()
    (run.checkpoints / "step_01").mkdir()  # parse_step reads it as 1; the protocol never writes it
    (run.checkpoints / "notes.txt").write_text("keep me")
    (run.checkpoints / "step_").mkdir()
    assert prune_steps(run.checkpoints, KeepPolicy(keep_last=1)) == [0, 1]
    assert steps_on_disk(run.checkpoints) == sorted(["notes.txt", "step_", "step_01", "step_0x", "step_2"])


def test_regular_file_named_like_a_step_is_left(run: RunDir) -> None:
    make_step(run.checkpoints, 5)
    (run.checkpoints / "step_1").write_text("not a folder")
    assert prune_steps(run.checkpoints, KeepPolicy(keep_last=1)) == []
    assert (run.checkpoints / "step_1").read_text() == "not a folder"


def test_symlinked_step_is_unlinked_not_followed(run: RunDir, tmp_path: Path) -> None:
    outside = make_step(tmp_path, 1)  # a stable-looking folder outside the run
    outside_new = make_step(tmp_path, 9)
    (run.broadcast / "step_1").symlink_to(outside)
    (run.broadcast / "step_9").symlink_to(outside_new)
    for step in (2, 3):
        make_step(run.broadcast, step)
    assert prune_steps(run.broadcast, KeepPolicy(keep_last=1)) == [1, 2]
    assert steps_on_disk(run.broadcast) == names(3, 9)  # step_9 is newer than the newest stable step
    for folder in (outside, outside_new):
        assert sorted(os.listdir(folder)) == [STABLE_MARKER, "payload.bin"]


def test_symlinked_parent_is_refused(run: RunDir, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for step in range(3):
        make_step(elsewhere, step)
    linked = run.root / "linked"
    linked.symlink_to(elsewhere)
    assert prune_steps(linked, KeepPolicy(keep_last=1)) == []
    assert steps_on_disk(elsewhere) == names(0, 1, 2)


def test_missing_parent_is_not_an_error(run: RunDir) -> None:
    assert prune_steps(run.root / "nothing_here", KeepPolicy(keep_last=1)) == []


def test_failure_is_logged_marker_first_and_retried(
    run: RunDir, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for step in range(3):
        make_step(run.checkpoints, step)

    def refuse(path: object, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(retention.shutil, "rmtree", refuse)
    assert prune_steps(run.checkpoints, KeepPolicy(keep_last=1)) == []
    # The folders stay, but without their marker: no reader takes them for stable any more.
    assert steps_on_disk(run.checkpoints) == names(0, 1, 2)
    assert [step for step, _ in stable_steps(run.checkpoints)] == [2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("Permission denied" in message for message in warnings)

    monkeypatch.undo()
    assert prune_steps(run.checkpoints, KeepPolicy(keep_last=1)) == [0, 1]
    assert steps_on_disk(run.checkpoints) == names(2)


# ---- remove_orphaned_temporaries -------------------------------------------------------------


@pytest.fixture
def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    with pytest.raises(ProcessLookupError):  # reaped: the pid names no process (unless reused)
        os.kill(child.pid, 0)
    return child.pid


@pytest.fixture
def live_pid() -> Iterator[int]:
    # Blocks on its stdin until the test ends: alive without any timing assumption.
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        yield child.pid
    finally:
        child.kill()
        child.wait()
        assert child.stdin is not None
        child.stdin.close()


def make_temp_dir(path: Path) -> Path:
    path.mkdir()
    (path / "payload.bin").write_bytes(b"x")
    (path / f".progress.json.tmp-{os.getpid()}").write_bytes(b"{}")  # nested: goes with its folder
    return path


def test_orphans_of_a_dead_writer_are_removed(run: RunDir, dead_pid: int) -> None:
    rollout_step = make_step(run.rollouts, 2, stable=False)
    broadcast_step = make_step(run.broadcast, 1)
    expected = [
        make_temp_dir(run.checkpoints / f".step_3.tmp-{dead_pid}"),
        make_temp_dir(run.broadcast / f".step_4.tmp-{dead_pid}"),
        make_temp_dir(run.broadcast / f".step_1.old-{dead_pid}"),  # step_1 exists: a redundant copy
        run.control / f".orch.toml.tmp-{dead_pid}",
        rollout_step / f".rollouts.safetensors.tmp-{dead_pid}",
        broadcast_step / f".STABLE.tmp-{dead_pid}",
    ]
    for path in expected:
        if not path.exists():
            path.write_bytes(b"half")
    assert sorted(remove_orphaned_temporaries(run.root)) == sorted(expected)
    assert not any(path.exists() for path in expected)
    assert steps_on_disk(run.broadcast) == names(1)
    assert sorted(os.listdir(rollout_step)) == ["payload.bin"]
    assert sorted(os.listdir(broadcast_step)) == [STABLE_MARKER, "payload.bin"]


def test_temporaries_of_live_writers_stay(run: RunDir, live_pid: int) -> None:
    kept = [
        make_temp_dir(run.checkpoints / f".step_3.tmp-{live_pid}"),
        make_temp_dir(run.checkpoints / f".step_4.tmp-{os.getpid()}"),
        run.control / f".evicted.txt.tmp-{live_pid}",
    ]
    kept[-1].write_bytes(b"")
    assert remove_orphaned_temporaries(run.root) == []
    assert all(path.exists() for path in kept)


def test_only_copy_left_by_a_dead_writer_stays(run: RunDir, dead_pid: int) -> None:
    # Died between renaming step_5 aside and renaming the new copy in: nothing else holds step 5.
    only_copy = make_temp_dir(run.broadcast / f".step_5.old-{dead_pid}")
    assert remove_orphaned_temporaries(run.root) == []
    assert only_copy.is_dir()


def test_other_names_and_folders_are_left(run: RunDir, dead_pid: int) -> None:
    left = [
        run.checkpoints / ".hidden",
        run.checkpoints / f"step_3.tmp-{dead_pid}",  # not hidden: not a temporary name
        run.checkpoints / f".step_3.bak-{dead_pid}",
        run.checkpoints / ".step_3.tmp-",
        run.root / f".orch.toml.tmp-{dead_pid}",  # the run root itself is not scanned
    ]
    (run.root / "elsewhere").mkdir()
    left.append(run.root / "elsewhere" / f".x.tmp-{dead_pid}")
    nested = make_step(run.checkpoints, 1)
    (nested / "sub").mkdir()
    left.append(nested / "sub" / f".deep.tmp-{dead_pid}")  # deeper than one level into a step
    for path in left:
        path.write_bytes(b"")
    assert remove_orphaned_temporaries(run.root) == []
    assert all(path.exists() for path in left)


def test_symlinked_temporary_is_unlinked_not_followed(run: RunDir, tmp_path: Path, dead_pid: int) -> None:
    outside = make_step(tmp_path, 7)
    link = run.checkpoints / f".step_7.tmp-{dead_pid}"
    link.symlink_to(outside)
    step_link = run.rollouts / "step_8"  # a step folder that is a symlink is not scanned inside
    step_link.symlink_to(outside)
    (outside / f".payload.bin.tmp-{dead_pid}").write_bytes(b"")
    assert remove_orphaned_temporaries(run.root) == [link]
    assert not os.path.lexists(link)
    assert sorted(os.listdir(outside)) == sorted([f".payload.bin.tmp-{dead_pid}", STABLE_MARKER, "payload.bin"])


def test_symlinked_kind_folder_is_not_scanned(tmp_path: Path, dead_pid: int) -> None:
    run = RunDir(tmp_path / "out", "run_b")
    run.root.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / f".data.tmp-{dead_pid}"
    victim.write_bytes(b"")
    run.checkpoints.symlink_to(elsewhere)
    assert remove_orphaned_temporaries(run.root) == []
    assert victim.exists()


def test_missing_run_root_is_not_an_error(tmp_path: Path) -> None:
    assert remove_orphaned_temporaries(tmp_path / "gone") == []
