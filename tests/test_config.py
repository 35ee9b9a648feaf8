from __future__ import annotations

from pathlib import Path

import pytest

from rlplex.config import load_config
from rlplex.errors import ConfigError, RlplexError
from rlplex.runners.config import TrainConfig


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_valid_config_loads(tmp_path: Path) -> None:
    config = load_config(TrainConfig, write(tmp_path, '[env]\nid = "CartPole-v1"\n[sampler]\nbatch_T = 16\n'))
    assert config.sampler.batch_T == 16
    assert config.algo.name == "ppo"


def test_bad_value_names_file_field_and_value(tmp_path: Path) -> None:
    path = write(tmp_path, '[env]\nid = "CartPole-v1"\n[sampler]\nbatch_T = -3\n')
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, path)
    message = str(info.value)
    assert str(path) in message and "sampler.batch_T" in message and "-3" in message


def test_unknown_field_is_an_error_not_ignored(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"algo\.ppo\.learning_rat"):
        text = '[env]\nid = "CartPole-v1"\n[algo]\nname = "ppo"\nlearning_rat = 0.1\n'
        load_config(TrainConfig, write(tmp_path, text))


def test_broken_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(TrainConfig, write(tmp_path, "[env\nid = 1"))
    with pytest.raises(ConfigError, match="not found"):
        load_config(TrainConfig, tmp_path / "missing.toml")


def test_every_config_error_is_an_rlplex_error() -> None:
    assert issubclass(ConfigError, RlplexError)
