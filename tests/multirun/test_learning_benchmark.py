"""Smoke tests of `benchmarks.multirun_learning`: the real trainer and orchestrator processes,
shared and alone, with a budget far too small to learn; the outputs must be written and sane.
And its command line: no flags is the reverse benchmark as it was, a preset or JSON settings
reach the environment and the base checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from benchmarks import multirun_learning
from benchmarks.multirun_learning import (
    ARITHMETIC,
    DEFAULT_SPECS,
    Budget,
    RunSpec,
    configure,
    model_settings,
    orch_config,
    run_benchmark,
)

from lm_models import CACHE, SMALL

STEPS = 3


@pytest.fixture
def tests_model_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmarks build their checkpoints in the tests' cache: a benchmark's tiny checkpoint of
    the same settings as a test's is then built once per suite, not once in outputs/models too."""
    from benchmarks import common

    monkeypatch.setattr(common, "MODELS", CACHE)


@pytest.fixture
def no_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """`orch_config` without building the base checkpoint: these tests look at settings only."""
    monkeypatch.setattr(multirun_learning, "base_model", lambda budget: "tiny-model")


@pytest.mark.usefixtures("no_checkpoint")
def test_command_line_without_a_preset_is_the_reverse_benchmark_as_before() -> None:
    setup = configure([])
    assert setup.budget == Budget() and setup.specs == DEFAULT_SPECS
    assert setup.options["target"] == 0.7 and setup.options["seed_check"]
    # The settings the cached checkpoint is keyed by: a bare task name, as before --env-json.
    assert model_settings(setup.budget) == {"tasks": ("reverse",), "warmup_steps": 75}
    assert orch_config(DEFAULT_SPECS[0], setup.budget, 0).env.name == "reverse"


@pytest.mark.usefixtures("no_checkpoint")
def test_command_line_preset_env_and_model_settings() -> None:
    assert configure(["--preset", "arithmetic"]).budget == ARITHMETIC.budget
    # The preset's environment and checkpoint settings reach the run's config and the cache key.
    preset = orch_config(DEFAULT_SPECS[0], ARITHMETIC.budget, 0).env
    assert (preset.name, preset.model_extra) == ("arithmetic", {"max_operand": 7, "operations": ["multiply"]})
    assert model_settings(ARITHMETIC.budget) == {"tasks": (ARITHMETIC.budget.env,), "warmup_steps": 125}
    overridden = configure(["--preset", "arithmetic", "--steps", "5", "--warmup-steps", "7"]).budget
    assert (overridden.env, overridden.steps, overridden.warmup_steps) == (ARITHMETIC.budget.env, 5, 7)
    assert configure(["--preset", "arithmetic", "--task", "reverse"]).budget.env_spec() == {"name": "reverse"}
    env = {"name": "arithmetic", "max_operand": 5}
    budget = configure(["--env-json", json.dumps(env), "--model-json", '{"hidden_size": 32, "warmup_steps": 9}']).budget
    assert budget.task == "arithmetic" and budget.env_spec() == env
    assert model_settings(budget) == {"tasks": (env,), "warmup_steps": 9, "hidden_size": 32}
    config = orch_config(DEFAULT_SPECS[0], budget, 0)
    assert config.env.name == "arithmetic" and config.env.model_extra == {"max_operand": 5}
    with pytest.raises(SystemExit):
        configure(["--env-json", '{"max_operand": 5}'])  # no name


@pytest.mark.slow
@pytest.mark.usefixtures("tests_model_cache")
def test_learning_benchmark_writes_json_and_png_with_numeric_rewards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real trainer and orchestrator processes, shared and alone, a few steps of 8 samples
    with a budget far too small to learn; the outputs must be written and sane. One run keeps the
    test to four processes (their start-up is most of its time); the benchmark's analysis and
    outputs are the same code for one run as for three, and for the reverse task as for the
    arithmetic preset, whose settings reach the configs (the command-line tests above). The
    preset's own checkpoint takes about 40 s to build: that smoke run is `--preset arithmetic
    --quick`, by hand."""
    monkeypatch.chdir(tmp_path)  # report() writes bench_results/ under the working directory
    specs = (RunSpec("run_a", 3e-3, 4, True),)
    # The small checkpoint every other LLM test trains (the same cache key): built once per suite.
    small = {key: value for key, value in SMALL.items() if key != "warmup_steps"}
    budget = Budget(
        steps=STEPS, batch_size=8, group_size=4, warmup_steps=int(SMALL["warmup_steps"]), model=small, timeout_s=120
    )
    figures = run_benchmark(
        tmp_path / "work", specs, budget, seed_check=False, parallel=2, window=2, name="mrlearn_smoke"
    )
    png, data = Path(figures["png"]), json.loads(Path(figures["json"]).read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Path(figures["json"]) == Path("bench_results/mrlearn_smoke.json")
    assert data["budget"]["task"] == "reverse" and data["base_model"]["tasks"] == ["reverse"]
    written = (tmp_path / "work" / "shared" / "configs" / "run_a.toml").read_text()
    assert 'name = "reverse"' in written
    assert [run["run_id"] for run in data["runs"]] == ["run_a"]
    for run in data["runs"]:
        for side in ("shared", "alone"):
            rewards = run[side]["rewards"]
            assert len(rewards) == STEPS
            assert all(isinstance(r, float) and 0.0 <= r <= 1.0 for r in rewards)
            assert math.isfinite(run[side]["first"]) and math.isfinite(run[side]["final"])
        assert run["gap_shared_vs_alone"]["max_abs"] >= run["gap_shared_vs_alone"]["mean_abs"] >= 0.0
        assert isinstance(run["within_noise"], bool)
        assert math.isfinite(run["shared"]["rise"])
    assert isinstance(data["goal_all_well_configured_rise"], bool)


@pytest.mark.usefixtures("tests_model_cache")
def test_the_orchestrator_rollouts_benchmark_generates_every_step() -> None:
    # It once measured nothing: its stand-in trainer published the final broadcast up front,
    # which tells a starting orchestrator that every step is trained already.
    from benchmarks.orchestrator_rollouts import make_config, measure

    figures = measure(make_config(steps=2, batch=8, group=4, warmup=40))  # the learning smoke's checkpoint
    assert figures["steps"] == 2 and figures["wall_tokens_per_s"] > 0
