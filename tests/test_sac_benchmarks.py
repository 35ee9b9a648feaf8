"""The SAC benchmarks run end to end at tiny sizes and write what they promise (the figures
themselves are for `python -m benchmarks.sac_update` / `benchmarks.mujoco_sac` at full size)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("stable_baselines3")
pytest.importorskip("mujoco")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_sac_update_times_both_libraries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import sac_update

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["sac_update", "--rounds", "1", "--steps", "3"])
    sac_update.main()
    result = json.loads((tmp_path / "bench_results" / "sac_update.json").read_text())
    assert set(result["median_wall_seconds_per_step"]) == {"rlplex", "sb3"}
    assert all(t > 0 for t in result["median_cpu_seconds_per_step"].values())
    assert math.isfinite(result["ratio_rlplex_to_sb3"]) and result["ratio_rlplex_to_sb3"] > 0


def test_dqn_update_times_rlplex_with_both_adams_and_sb3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import dqn_update

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["dqn_update", "--rounds", "1", "--steps", "3"])
    dqn_update.main()
    result = json.loads((tmp_path / "bench_results" / "dqn_update.json").read_text())
    assert set(result["median_wall"]) == {"rlplex", "rlplex, per-parameter Adam", "sb3"}
    assert all(t > 0 for t in result["median_cpu"].values())
    assert math.isfinite(result["ratio_rlplex_to_sb3"]) and result["ratio_per_parameter_to_fused_adam"] > 0


@pytest.mark.slow
def test_mujoco_sac_trains_both_libraries_on_halfcheetah(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import mujoco_sac

    monkeypatch.chdir(tmp_path)
    mujoco_sac.main(["--steps", "200", "--learning-starts", "100", "--seeds", "1", "--eval-every", "100",
                     "--eval-episodes", "1"])  # fmt: skip
    result = json.loads((tmp_path / "bench_results" / "mujoco_sac.json").read_text())
    (run,) = result["runs"]
    for side in ("rlplex", "sb3"):
        assert [step for step, _ in run[side]["curve"]] == [100, 200], run[side]  # the same evaluation points
        assert run[side]["train_s"] > 0 and run[side]["train_cpu_s"] > 0
    assert (tmp_path / "bench_results" / "mujoco_sac.png").read_bytes()[:8] == PNG_MAGIC
