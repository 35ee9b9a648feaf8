from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rlplex.errors import SnapshotError
from rlplex.io import snapshot as snap


def nested_state() -> dict[str, object]:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": snap.rng_state(), "itr": 4}


def test_roundtrip_keeps_int_keys_tuples_and_arrays(tmp_path: Path) -> None:
    state = nested_state()
    snap.write_snapshot(tmp_path / "itr_4", state)
    loaded = snap.read_snapshot(tmp_path / "itr_4")
    assert set(loaded["optimizer"]["state"]) == {0, 1}  # int keys survive JSON
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])  # type: ignore[index]
    assert isinstance(loaded["rng"]["numpy"], tuple) and isinstance(loaded["rng"]["numpy"][1], np.ndarray)
    # The restored optimizer state is usable as is.
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    optimizer.load_state_dict(loaded["optimizer"])
    model.load_state_dict(loaded["model"])


def test_rng_state_restores_exact_streams(tmp_path: Path) -> None:
    snap.write_snapshot(tmp_path / "itr_0", {"rng": snap.rng_state()})
    expected = (torch.rand(3), np.random.rand(3))
    snap.set_rng_state(snap.read_snapshot(tmp_path / "itr_0")["rng"])
    assert torch.equal(torch.rand(3), expected[0]) and np.array_equal(np.random.rand(3), expected[1])


def test_failed_write_leaves_previous_snapshot_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "itr_1"
    snap.write_snapshot(target, {"x": torch.ones(2)})

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snap, "save_file", disk_full)
    with pytest.raises(OSError):
        snap.write_snapshot(target, {"x": torch.zeros(2)})
    assert torch.equal(snap.read_snapshot(target)["x"], torch.ones(2))
    assert [i for i, _ in snap.list_snapshots(tmp_path)] == [1]


def test_modes_last_all_gap(tmp_path: Path) -> None:
    for mode, expected in (("last", [3]), ("all", [0, 1, 2, 3]), ("gap", [1, 3])):
        folder = tmp_path / mode
        for itr in range(4):
            snap.save_by_mode(folder, itr, {"itr": itr}, mode, gap=2)  # type: ignore[arg-type]
        assert [i for i, _ in snap.list_snapshots(folder)] == expected


def test_corrupt_or_missing_snapshot_is_named(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="no snapshot"):
        snap.latest_snapshot(tmp_path)
    (tmp_path / "itr_2").mkdir()
    (tmp_path / "itr_2" / "state.json").write_text("{")
    (tmp_path / "itr_2" / "tensors.safetensors").write_bytes(b"garbage")
    with pytest.raises(SnapshotError, match="itr_2"):
        snap.read_snapshot(tmp_path / "itr_2")


def test_incompatible_parameters_refused(tmp_path: Path) -> None:
    small, big = torch.nn.Linear(3, 2).state_dict(), torch.nn.Linear(3, 4).state_dict()
    with pytest.raises(SnapshotError, match="'weight' has shape"):
        snap.check_compatible(big, small, tmp_path)
