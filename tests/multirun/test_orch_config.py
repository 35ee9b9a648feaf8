from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest
from mr_helpers import make_config

from rlplex.errors import RunConfigError
from rlplex.multirun import MAX_ORCH_CONFIG_BYTES, OrchestratorConfig, orch_config_to_toml, read_orch_config

HEAD = 'env = { name = "t" }\nmax_steps = 3\nbatch_size = 2\n[model]\nname = "m"\n'


def write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def test_round_trip_through_toml(tmp_path: Path) -> None:
    config = make_config(model={"lora": {"rank": 4, "alpha": 8.0}}, optim={"lr": 3e-4, "max_grad_norm": 0.5})
    path = write(tmp_path / "orch.toml", orch_config_to_toml(config))
    assert read_orch_config(path) == config
    assert tomllib.loads(path.read_text())["model"]["lora"]["rank"] == 4


def test_defaults_and_int_alpha_accepted(tmp_path: Path) -> None:
    body = 'env = { name = "t" }\nmax_steps = 3\nbatch_size = 2\n[model]\nname = "m"\n[model.lora]\nalpha = 32\n'
    path = write(tmp_path / "orch.toml", body)
    config = read_orch_config(path)
    assert (config.model.lora.rank, config.model.lora.alpha, config.max_async_level) == (8, 32.0, 1)
    assert config.reward_timeout_s == 10.0


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (f'{HEAD}[model.lora]\nrank = "8"\n', "model.lora.rank"),
        ('env = { name = "t" }\nmax_steps = "many"\nbatch_size = 2\n', "max_steps"),
        ('env = { name = "t" }\nmax_steps = 3\nbatch_size = 0\n', "batch_size"),
        (f"{HEAD}[optim]\nlr = -1.0\n", "optim.lr"),
        ('learning_rat = 1.0\nenv = { name = "t" }\nmax_steps = 3\nbatch_size = 2\n', "learning_rat"),
        ('max_steps = 3\nbatch_size = 2\n[model]\nname = "m"\n', "env"),
        ('env = { name = "t" }\nmax_steps = 3\nbatch_size = 2\n', "model"),
        (f'{HEAD}dtype = "float16"\n', "model.dtype"),
        (
            'reward_timeout_s = 0\nenv = { name = "t" }\nmax_steps = 3\nbatch_size = 2\n[model]\nname = "m"\n',
            "reward_timeout_s",
        ),
    ],
)
def test_wrong_types_and_values_name_the_field(tmp_path: Path, body: str, expected: str) -> None:
    path = write(tmp_path / "orch.toml", body)
    with pytest.raises(RunConfigError, match=f"field '{expected}'") as info:
        read_orch_config(path)
    assert str(path) in str(info.value)


def test_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(RunConfigError, match="not valid TOML"):
        read_orch_config(write(tmp_path / "orch.toml", "task = = 1\n"))


def test_huge_file_refused_before_reading(tmp_path: Path) -> None:
    path = write(tmp_path / "orch.toml", b"#" * (MAX_ORCH_CONFIG_BYTES + 1))
    with pytest.raises(RunConfigError, match="more than the limit"):
        read_orch_config(path)


def test_not_utf8(tmp_path: Path) -> None:
    with pytest.raises(RunConfigError, match="not UTF-8"):
        read_orch_config(write(tmp_path / "orch.toml", b"task = '\xff\xfe'\n"))


def test_directory_and_fifo_refused_without_blocking(tmp_path: Path) -> None:
    (tmp_path / "dir.toml").mkdir()
    with pytest.raises(RunConfigError, match="not a regular file"):
        read_orch_config(tmp_path / "dir.toml")
    os.mkfifo(tmp_path / "fifo.toml")
    with pytest.raises(RunConfigError, match="not a regular file"):
        read_orch_config(tmp_path / "fifo.toml")


def test_missing(tmp_path: Path) -> None:
    with pytest.raises(RunConfigError, match="not found"):
        read_orch_config(tmp_path / "orch.toml")


def test_config_is_frozen() -> None:
    config = make_config()
    with pytest.raises(ValueError):
        config.seed = 3  # type: ignore[misc]
    assert isinstance(config, OrchestratorConfig)


def test_strings_with_newlines_and_lists_write_valid_toml(tmp_path: Path) -> None:
    config = make_config(env={"name": "jsonl", "path": 'a "quoted"\nname\\x', "fields": ["a", "b"]})
    path = write(tmp_path / "orch.toml", orch_config_to_toml(config))
    assert read_orch_config(path) == config


def test_evaluation_defaults_to_the_held_out_split_and_names_bad_settings(tmp_path: Path) -> None:
    env = {"name": "arithmetic", "heldout_fraction": 0.1, "split": "train"}
    config = make_config(env=env, evaluation={"every": 5})
    assert config.evaluation is not None and config.evaluation.temperatures == [0.0, 1.0]
    assert config.evaluation.env_spec(config.env).model_extra == {"heldout_fraction": 0.1, "split": "heldout"}
    # Without a held-out share, the run's own environment (a fixed, seeded set of its examples).
    plain = make_config(evaluation={})
    assert plain.evaluation is not None and plain.evaluation.env_spec(plain.env) == plain.env
    assert read_orch_config(write(tmp_path / "e.toml", orch_config_to_toml(config))) == config
    for body, field in (
        (f"{HEAD}[evaluation]\nevery = 0\n", "evaluation.every"),
        (f"{HEAD}[evaluation]\ntemperatures = [0.0, 11.0]\n", "evaluation.temperatures"),
        (f"{HEAD}rollout_workers = 2\n[evaluation]\nexamples = 4\n", "evaluation"),
    ):
        with pytest.raises(RunConfigError, match=field):
            read_orch_config(write(tmp_path / "bad.toml", body))
