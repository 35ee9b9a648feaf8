"""benchmarks.vs_trl's two sides get the same run, checked without running TRL or a job (and
without trl installed): the benchmark takes minutes, TRL is a bench-only dependency."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from benchmarks.vs_trl_runs import (
    Preset,
    TrlJob,
    case_runs,
    job_toml,
    lora_arguments,
    rlplex_job,
    rlplex_job_data,
    smollm2_preset,
    tiny_preset,
    trl_arguments,
    trl_micro_batch,
)

from rlplex.config import validate_config
from rlplex.mainjob.config import MainJobConfig
from rlplex.multirun.trainer.config import CLIP_EPS


@pytest.mark.parametrize("preset", [tiny_preset(), smollm2_preset()], ids=lambda p: p.label)
@pytest.mark.parametrize("case", ["A", "B"])
def test_both_sides_train_the_same_runs(tmp_path: Path, preset: Preset, case: str) -> None:
    runs = case_runs(preset, str(tmp_path / "model"), case, steps=7)
    job = rlplex_job(runs, tmp_path / "job", "bench")
    assert len(job.runs) == len(runs) == (1 if case == "A" else 3) and job.trainer.max_runs == len(runs)
    assert job.inference.engine == "hf" and job.model.name == str(tmp_path / "model")
    for entry, run in zip(job.runs, runs, strict=True):
        ours = entry.orch_config("bench")
        micro = trl_micro_batch(run, preset.trl_micro_rows)
        theirs = trl_arguments(TrlJob(run=run, threads=1, micro_batch=micro, output_dir="out"))
        lora = lora_arguments(run)
        # Prompts per step and group: rlplex's batch_size is prompts x group; TRL's step is its
        # micro-batches accumulated, one generation of num_generations per prompt.
        assert ours.batch_size // ours.group_size == run.prompts
        step_rows = theirs["per_device_train_batch_size"] * theirs["gradient_accumulation_steps"]
        assert step_rows == ours.batch_size and theirs["num_generations"] == ours.group_size
        assert theirs["max_completion_length"] == ours.max_new_tokens == run.max_new_tokens
        assert theirs["learning_rate"] == ours.optim.lr and theirs["max_grad_norm"] == ours.optim.max_grad_norm
        assert theirs["weight_decay"] == ours.optim.weight_decay
        assert (lora["r"], lora["lora_alpha"]) == (ours.model.lora.rank, ours.model.lora.alpha)
        assert theirs["max_steps"] == ours.max_steps == 7 and theirs["temperature"] == ours.temperature
        assert theirs["seed"] == ours.seed and dict(ours.env.model_extra or {}, name=ours.env.name) == run.env
        assert theirs["epsilon"] == CLIP_EPS and theirs["beta"] == 0.0 and theirs["num_iterations"] == 1
        assert not theirs["bf16"] and not theirs["shuffle_dataset"]
    if case == "B":  # three runs that differ only in learning rate and seed
        assert len({run.lr for run in runs}) == 3
        assert len({run.model_dump_json(exclude={"run_id", "lr", "seed"}) for run in runs}) == 1


def test_the_smollm2_runs_are_the_demos(tmp_path: Path) -> None:
    preset = smollm2_preset()
    demo = [
        entry.orch_config("demo")
        for entry in rlplex_job(case_runs(preset, str(tmp_path), "B", steps=30), tmp_path / "j", "b").runs
    ]
    assert [run.optim.lr for run in demo] == list(preset.lrs)
    assert {(run.batch_size, run.group_size, run.model.lora.rank) for run in demo} == {(32, 8, 16)}


def test_the_job_file_reads_back_as_the_job(tmp_path: Path) -> None:
    runs = case_runs(tiny_preset(), str(tmp_path / "model"), "B", steps=3)
    data = rlplex_job_data(runs, tmp_path / "job", "bench")
    read = validate_config(MainJobConfig, tomllib.loads(job_toml(data)))
    assert read == rlplex_job(runs, tmp_path / "job", "bench")
