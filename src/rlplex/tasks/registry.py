"""Environments by name: a config says `env = { name = "reverse" }`, and the other keys are that environment's settings.

Each environment validates its settings with its own pydantic model, so a typo in a setting is a
`ConfigError` naming the field and value, as anywhere else in a config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from pydantic import ConfigDict, Field

from rlplex.config import StrictModel, validate_config
from rlplex.errors import ConfigError
from rlplex.tasks.arithmetic import ArithmeticEnv, ArithmeticSettings
from rlplex.tasks.environment import Environment
from rlplex.tasks.files import FileEnv, FileSettings
from rlplex.tasks.reward_guard import RowFailure, guarded_outcomes
from rlplex.tasks.toy import AddEnv, AddSettings, ReverseEnv, ReverseSettings, SortDigitsEnv, SortDigitsSettings


class EnvSpec(StrictModel):
    """An environment's name; the extra keys are the environment's own settings."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(description="reverse, sort_digits, add, arithmetic, jsonl or parquet; the rest: its settings")


@dataclass(frozen=True)
class _Entry:
    settings: type[StrictModel]
    build: Callable[[Any], Environment]


_ENVIRONMENTS: dict[str, _Entry] = {
    "reverse": _Entry(ReverseSettings, ReverseEnv),
    "sort_digits": _Entry(SortDigitsSettings, SortDigitsEnv),
    "add": _Entry(AddSettings, AddEnv),
    "arithmetic": _Entry(ArithmeticSettings, ArithmeticEnv),
    "jsonl": _Entry(FileSettings, partial(FileEnv, file_format="json", name="jsonl")),
    "parquet": _Entry(FileSettings, partial(FileEnv, file_format="parquet", name="parquet")),
}


def environment_names() -> list[str]:
    return sorted(_ENVIRONMENTS)


def environment_settings() -> dict[str, type[StrictModel]]:
    """Each environment's name and the model of its own settings (the other keys of `env`)."""
    return {name: _ENVIRONMENTS[name].settings for name in environment_names()}


def load_environment(spec: EnvSpec | Mapping[str, Any] | str) -> Environment:
    """Build the environment `spec` names, with its settings; a str is just the name."""
    if isinstance(spec, str):
        spec = EnvSpec(name=spec)
    elif not isinstance(spec, EnvSpec):
        spec = validate_config(EnvSpec, dict(spec), source="env")
    entry = _ENVIRONMENTS.get(spec.name)
    if entry is None:
        known = ", ".join(environment_names())
        raise ConfigError(f"env: field 'name': unknown environment {spec.name!r}; known environments: {known}")
    settings = validate_config(entry.settings, dict(spec.model_extra or {}), source=f"env {spec.name!r}")
    return entry.build(settings)


def check_environment(spec: EnvSpec | Mapping[str, Any] | str) -> None:
    """What a run's start would find wrong with its environment, found now: its settings, its
    data (read whole), and its reward (imported, and called once, under the guard's deadline,
    on a row with the row's own answer as the completion: a reward that raises there, returns
    no number or runs past the deadline is a mistake in it, not in a model's output). Raises
    `ConfigError`."""
    import numpy as np

    environment = load_environment(spec)
    if not isinstance(environment, FileEnv):  # rlplex's own environments: built means checked
        return
    (example,) = environment.sample(1, np.random.default_rng(0))
    what = f"env {environment.name!r}: field 'reward': {environment.settings.reward!r}"
    (outcome,) = guarded_outcomes(environment.reward, [(example.prompt_text, example.answer, example.answer)])
    if not isinstance(outcome, RowFailure):
        return
    if outcome.kind == "returned":
        raise ConfigError(f"{what} {outcome.text} on a row of its data; a reward returns a finite number")
    raise ConfigError(f"{what} {outcome.text:.210} on a row of its data (its answer as the completion)")
