"""The main job's Python API builds the same `MainJobConfig` a TOML file loads into, with the same
errors; `run_job` itself runs in tests/mainjob/test_main_job_e2e.py (the quickstart's train.py)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from rlplex.errors import ConfigError
from rlplex.mainjob.api import main_job, reward_path, run
from rlplex.mainjob.config import load_main_job

ROOT = Path(__file__).resolve().parents[2]


def test_the_quickstart_built_in_python_is_the_job_its_toml_file_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the file's relative paths are the repository root's
    monkeypatch.syspath_prepend(str(ROOT))
    reward = importlib.import_module("examples.my_data.my_reward").exact_number
    from_python = main_job(
        "my-data",
        "outputs/my-data",
        model="outputs/models/smollm2-135m",
        trainer={"world_size": 1},
        runs=[
            run(
                "run_mine",
                data="examples/my_data/problems.jsonl",
                reward=reward,
                messages_field="messages",
                answer_field="answer",
                max_new_tokens=16,
                max_steps=20,
                batch_size=16,
                group_size=4,
                optim={"lr": 1e-3},
                temperature=0.7,
                model={"lora": {"rank": 8, "alpha": 16.0}},
            )
        ],
    )
    assert from_python == load_main_job(ROOT / "examples" / "my_data" / "job.toml")


def test_a_dataset_is_written_into_the_job_folder_and_read_from_there(tmp_path: Path) -> None:
    from datasets import Dataset

    rows = [{"prompt": f"r:{w}>", "answer": w[::-1]} for w in ("abc", "hgf", "dcb")]
    job = main_job(
        "from-a-dataset",
        tmp_path / "job",
        model="some/model",
        runs=[run("run_d", data=Dataset.from_list(rows), reward="rlplex.tasks.rewards:positional_match",
                  max_steps=2, batch_size=4, group_size=2)],
    )  # fmt: skip
    env = job.runs[0].config["env"]
    assert (env["name"], env["path"]) == ("jsonl", str((tmp_path / "job" / "data" / "run_d.jsonl").resolve()))
    assert [json.loads(line) for line in Path(env["path"]).read_text().splitlines()] == rows
    assert job.runs[0].orch_config("test").model.name == "some/model"  # the job's model, as a file's run gets it


def test_mistakes_are_one_line_naming_the_run_and_field() -> None:
    with pytest.raises(ConfigError, match="cannot be imported by the job's processes; define it at the top level"):
        run("run_x", data="rows.jsonl", reward=lambda prompt, completion, answer: 1.0)

    def local(prompt: str, completion: str, answer: str) -> float:
        return 1.0

    with pytest.raises(ConfigError, match=r"<locals>\.local cannot be imported"):
        reward_path(local)
    with pytest.raises(ConfigError, match="run 'run_x': give env or data, not both"):
        run("run_x", env="reverse", data="rows.jsonl", reward="m:f")
    with pytest.raises(ConfigError, match="run 'run_x': data needs a reward"):
        run("run_x", data="rows.jsonl")
    with pytest.raises(ConfigError) as error:
        main_job("j", "out", model="m", runs=[run("run_x", env="reverse", max_stepz=3, batch_size=4)])
    assert "run 'run_x'" in str(error.value) and "max_stepz" in str(error.value)
    with pytest.raises(ConfigError, match="is not a valid run id"):
        run("x y", env="reverse")
