"""benchmarks.real_model_learning's jobs, checked without running them (the benchmark trains
SmolLM2 for minutes; `tests/mainjob/test_main_job_e2e.py` runs a main job on SmolLM2)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.real_model_learning import MODEL, job_config


def test_shared_and_alone_jobs_are_the_demo_job_with_the_benchmarks_budget(tmp_path: Path) -> None:
    shared = job_config(tmp_path / "shared", steps=5, examples=12)
    runs = [entry.orch_config("bench") for entry in shared.runs]
    assert len(runs) == 3 and {run.max_steps for run in runs} == {5} and shared.model.name == str(MODEL)
    assert all(run.evaluation is not None and run.evaluation.examples == 12 for run in runs)
    alone = job_config(tmp_path / "alone", steps=5, examples=12, only=shared.runs[1].id)
    (run,) = [entry.orch_config("bench") for entry in alone.runs]
    # The same run (seed, learning rate, evaluation); only its job's folder (the engine's endpoint)
    # and its job's name (the W&B group its logging takes) differ.
    differ = {"inference", "logging"}
    assert alone.trainer.max_runs == 1 and run.model_dump(exclude=differ) == runs[1].model_dump(exclude=differ)
    assert run.logging.tensorboard == runs[1].logging.tensorboard
