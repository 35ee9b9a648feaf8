"""Smoke test of `benchmarks.multirun_learning`: the real trainer and orchestrator processes,
shared and alone, with a budget far too small to learn; the outputs must be written and sane."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from benchmarks.multirun_learning import Budget, RunSpec, run_benchmark

STEPS = 3


def test_learning_benchmark_writes_json_and_png_with_numeric_rewards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # report() writes bench_results/ under the working directory
    # One run keeps the test to four processes (their start-up is most of its time); the
    # benchmark's analysis and outputs are the same code for one run as for three.
    specs = (RunSpec("run_a", 3e-3, 4, True),)
    budget = Budget(steps=STEPS, batch_size=8, group_size=4, warmup_steps=40, timeout_s=120)
    figures = run_benchmark(
        tmp_path / "work", specs, budget, seed_check=False, parallel=2, window=2, name="mrlearn_smoke"
    )
    png, data = Path(figures["png"]), json.loads(Path(figures["json"]).read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Path(figures["json"]) == Path("bench_results/mrlearn_smoke.json")
    assert [run["run_id"] for run in data["runs"]] == ["run_a"]
    for run in data["runs"]:
        for side in ("shared", "alone"):
            rewards = run[side]["rewards"]
            assert len(rewards) == STEPS
            assert all(isinstance(r, float) and 0.0 <= r <= 1.0 for r in rewards)
            assert math.isfinite(run[side]["first"]) and math.isfinite(run[side]["final"])
        assert run["gap_shared_vs_alone"]["max_abs"] >= run["gap_shared_vs_alone"]["mean_abs"] >= 0.0
        assert isinstance(run["within_noise"], bool)
