"""Configs are small pydantic models loaded from TOML.

`load_config` turns every failure (a missing file, broken TOML, a wrong field) into one
`ConfigError` whose message names the file, the field path and the offending value.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from rlplex.errors import ConfigError
from rlplex.io.safe_files import read_regular_file

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    """Base for rlplex configs: unknown fields are errors (a typo must not be silently ignored)."""

    # allow_inf_nan=False: `learning_rate = inf` or `nan` must fail at load, not at step 1.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _field_path(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc) or "<root>"


def format_validation_error(source: str, error: ValidationError) -> str:
    """One line for one problem (the usual case: a user's one typo); a line per problem otherwise."""
    problems = []
    for item in error.errors():
        value = item.get("input")
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        problems.append(f"field '{_field_path(item['loc'])}': {item['msg']} (got {shown})")
    if len(problems) == 1:
        return f"{source}: {problems[0]}"
    return "\n  ".join([f"{source}: invalid config ({len(problems)} problems)", *problems])


def validate_config(model: type[M], data: dict[str, Any], source: str = "<config>") -> M:
    """Validate a mapping against a config model, raising `ConfigError` that names source and fields."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise ConfigError(format_validation_error(source, error)) from None


MAX_CONFIG_BYTES = 16 << 20


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        # A FIFO or a link to a device given as a config would block or never end: refuse it.
        text = read_regular_file(path, MAX_CONFIG_BYTES, follow_symlinks=True).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot read config file: {error}") from None
    return parse_toml(text, str(path))


def parse_toml(text: str, source: str) -> dict[str, Any]:
    """TOML text (a file's, or one pasted into the dashboard) as a mapping; `source` names it."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{source}: not valid TOML: {error}") from None


# The top-level keys that tell the four kinds of TOML file apart, and the command for each.
FILE_KINDS = {
    "train": ({"sampler", "algo", "runner"}, "a runner's train config", "rlplex train FILE"),
    "job": ({"roles"}, "a control-plane job", "rlplex job run FILE"),
    "main": ({"trainer", "runs"}, "a main job", "rlplex run FILE"),
    "orch": ({"max_steps"}, "one run's orchestrator config", "rlplex runs add DIR --config FILE"),
}


def check_config_kind(data: dict[str, Any], source: str, expected: str) -> None:
    """A config of another kind fails in one line naming its kind and command, instead of with
    every field the expected kind lacks."""
    keys = set(data)
    if FILE_KINDS[expected][0] & keys:
        return
    for markers, what, command in (v for k, v in FILE_KINDS.items() if k != expected):
        if markers <= keys:
            wanted = FILE_KINDS[expected][1]
            raise ConfigError(f"{source}: this is {what}, not {wanted}; run it with `{command}`")


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def toml_value(item: Any) -> str:
    """`item` as a TOML value (tomllib has no writer): tables inline, None fields left out (TOML
    has no null; they read back as their defaults)."""
    if isinstance(item, bool):
        return "true" if item else "false"
    if isinstance(item, int | float):
        return repr(item)
    if isinstance(item, str):
        return json.dumps(item)  # a JSON string is a TOML basic string, control characters escaped
    if isinstance(item, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in item) + "]"
    if isinstance(item, dict):
        pairs = (f"{toml_key(k)} = {toml_value(v)}" for k, v in item.items() if v is not None)
        return "{ " + ", ".join(pairs) + " }"
    raise TypeError(f"cannot write {type(item).__name__} to TOML")


def toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def load_config(model: type[M], path: str | Path) -> M:
    """Load a TOML file into `model`."""
    return validate_config(model, read_toml(path), source=str(path))
