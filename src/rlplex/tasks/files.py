"""A user's own dataset: a local JSONL or Parquet file of prompts and answers, and a reward named by dotted path.

Rows hold a raw text prompt (`prompt_field`) or a chat message list (`messages_field`), and an
answer. Every row is checked when the file loads, so a bad row fails the config at start, naming
file, row and field, instead of failing a training step hours later.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field

from rlplex.config import StrictModel
from rlplex.errors import ConfigError
from rlplex.tasks.environment import Example, as_messages, safe_scores
from rlplex.tasks.rewards import import_reward

FileFormat = Literal["json", "parquet"]


class FileSettings(StrictModel):
    path: Path = Field(description="the data file; a relative path is relative to the current directory")
    prompt_field: str = Field("prompt", description="the column holding each row's prompt text")
    messages_field: str | None = Field(
        None, description="the column holding chat message lists instead (then prompt_field is unused)"
    )
    answer_field: str = Field("answer", description="the column the reward gets as its answer")
    reward: str = Field(description="'package.module:function', called as (prompt, completion, answer) -> float")
    max_new_tokens: int = Field(64, ge=1, description="generation length of a reply")
    shuffle: bool = Field(True, description="draw the rows in a seeded random order, not the file's")


def check_file(path: Path) -> None:
    if not path.exists():
        raise ConfigError(f"{path}: data file not found")
    if not path.is_file():
        raise ConfigError(f"{path}: not a regular file")
    if path.stat().st_size == 0:
        raise ConfigError(f"{path}: data file is empty")


def read_rows(path: Path, file_format: FileFormat, fields: Sequence[str]) -> list[dict[str, Any]]:
    """The file's rows, reduced to `fields`, through `datasets` (local files only, never the hub)."""
    # Imported here: `datasets` takes about a second to import, which runs without user data should not pay.
    import datasets

    check_file(path)
    # Its progress bars ("Generating train split") would only interleave with rlplex's own lines.
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        dataset = datasets.load_dataset(file_format, data_files=str(path), split="train")
    except Exception as error:  # datasets and pyarrow raise many types for a malformed file; all mean the same
        raise ConfigError(f"{path}: cannot read as {file_format}: {error!r:.300}") from None
    finally:
        if bars:
            datasets.enable_progress_bars()
    if len(dataset) == 0:
        raise ConfigError(f"{path}: data file has no rows")
    missing = [field for field in fields if field not in dataset.column_names]
    if missing:
        raise ConfigError(
            f"{path}: row 0: field {missing[0]!r} is missing (the rows have fields: {', '.join(dataset.column_names)})"
        )
    rows: list[dict[str, Any]] = dataset.select_columns(list(fields)).to_list()
    return rows


def _text(value: object, path: Path, row: int, field: str, allow_int: bool) -> str:
    if value is None:
        raise ConfigError(f"{path}: row {row}: field {field!r} is missing")
    # An integer answer (a JSON number) is unambiguous as text; a float's text form is not, so it is refused.
    if allow_int and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise ConfigError(f"{path}: row {row}: field {field!r} must be a string (got {value!r:.80})")
    return value


def row_to_example(record: dict[str, Any], settings: FileSettings, path: Path, row: int) -> Example:
    answer = _text(record.get(settings.answer_field), path, row, settings.answer_field, allow_int=True)
    if settings.messages_field is None:
        prompt = _text(record.get(settings.prompt_field), path, row, settings.prompt_field, allow_int=False)
        return Example(prompt=prompt, answer=answer)
    value = record.get(settings.messages_field)
    if value is None:
        raise ConfigError(f"{path}: row {row}: field {settings.messages_field!r} is missing")
    try:
        messages = as_messages(value)
    except ConfigError as error:
        raise ConfigError(f"{path}: row {row}: field {settings.messages_field!r}: {error}") from None
    return Example(messages=messages, answer=answer)


def load_examples(settings: FileSettings, file_format: FileFormat) -> list[Example]:
    path = settings.path.expanduser().absolute()
    prompt_field = settings.messages_field or settings.prompt_field
    rows = read_rows(path, file_format, list(dict.fromkeys([prompt_field, settings.answer_field])))
    return [row_to_example(record, settings, path, row) for row, record in enumerate(rows)]


class FileEnv:
    """Samples rows epoch by epoch: every row once, in an order drawn from the rng, before any row repeats."""

    def __init__(self, settings: FileSettings, file_format: FileFormat, name: str) -> None:
        self.name = name
        self.settings = settings
        self.max_new_tokens = settings.max_new_tokens
        try:
            self.reward = import_reward(settings.reward, field="reward")
        except ConfigError as error:
            raise ConfigError(f"env {name!r}: {error}") from None
        self.examples = load_examples(settings, file_format)
        self._order = np.arange(0)
        self._next = 0
        # Several rollout threads may share one environment; the epoch cursor must advance for one at a time.
        self._lock = threading.Lock()

    def sample(self, n: int, rng: np.random.Generator) -> list[Example]:
        picked: list[int] = []
        with self._lock:
            while len(picked) < n:
                if self._next == len(self._order):
                    count = len(self.examples)
                    self._order = rng.permutation(count) if self.settings.shuffle else np.arange(count)
                    self._next = 0
                take = min(n - len(picked), len(self._order) - self._next)
                picked.extend(self._order[self._next : self._next + take].tolist())
                self._next += take
        return [self.examples[i] for i in picked]

    def score(self, examples: Sequence[Example], completions: Sequence[str]) -> list[float]:
        return safe_scores(self.reward, examples, completions, self.name)
