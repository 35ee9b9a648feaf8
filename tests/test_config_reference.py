"""docs/config-reference.md is what the config models say, and says what every field means."""

from __future__ import annotations

from pathlib import Path

from rlplex.config_reference import REFERENCE_FILE, missing_descriptions, render, sections
from rlplex.mainjob.config import MainJobConfig

ROOT = Path(__file__).resolve().parents[1]


def test_the_reference_in_the_repository_is_the_generated_one() -> None:
    assert (ROOT / REFERENCE_FILE).read_text() == render(), "docs/config-reference.md is stale: run `make docs`"


def test_every_field_of_every_file_says_what_it_means() -> None:
    assert missing_descriptions() == [], "give these fields a Field(description=...)"


def test_every_table_of_a_main_job_and_of_a_run_has_its_section_with_each_field() -> None:
    text = render()
    for section in sections(MainJobConfig, ""):
        heading = f"[[{section.path}]]" if section.is_list else f"[{section.path}]"
        assert not section.path or f"### `{heading}`" in text, heading
    chapter = text.split("## A run's config", 1)[1].split("\n## ", 1)[0]
    for field in ("max_steps", "batch_size", "group_size", "max_async_level", "reward_timeout_s", "threads"):
        assert f"| `{field}` |" in chapter, field
    assert '#### `env.name = "jsonl"`' in chapter and "| `reward` | str | required |" in chapter
    # Bounds come from the fields themselves: world_size is checked to be 1..8 at load.
    assert "| `world_size` | int, ≥ 1, ≤ 8 | `2` |" in text
