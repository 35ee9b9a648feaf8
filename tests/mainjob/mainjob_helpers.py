"""Tiny main-job files for the end-to-end tests: the small tiny checkpoint and batches of 8."""

from __future__ import annotations

from pathlib import Path

from lm_models import small_tiny_model

BATCH = 8


def run_config(seed: int, steps: int, extra: str = "") -> str:
    """One run's inline orchestrator config."""
    tail = f", {extra}" if extra else ""
    return (
        f'{{ seed = {seed}, env = {{ name = "reverse" }}, max_steps = {steps}, batch_size = {BATCH}, '
        f"group_size = 4{tail} }}"
    )


def tiny_job(
    name: str,
    output_dir: Path,
    runs: dict[str, str],
    later_runs: dict[str, str] | None = None,
    backend: str = "local",
    max_runs: int = 4,
    rest: str = "",
    model: Path | None = None,
    trainer: str = "",
    world_size: int = 2,
) -> str:
    """A main-job TOML of `world_size` trainer ranks; `runs`/`later_runs` map run ids to
    `run_config()`s, `rest` is appended as is (events), `trainer` into the [trainer] table; the
    model is the small tiny checkpoint unless `model`. Two ranks where a test needs the ranks'
    gloo group (a rank killed, re-rendezvous, Ray placement); one elsewhere saves a rank's
    process and its imports at every start of the job."""
    lines = [
        f'name = "{name}"',
        f'output_dir = "{output_dir}"',
        f'backend = "{backend}"',
        "timeout_s = 400",
        "[model]",
        f'name = "{model or small_tiny_model()}"',
        "[trainer]",
        f"world_size = {world_size}",
        f"max_runs = {max_runs}",
        *([trainer] if trainer else []),
    ]
    for table, entries in (("runs", runs), ("later_runs", later_runs or {})):
        for run_id, config in entries.items():
            lines += [f"[[{table}]]", f'id = "{run_id}"', f"config = {config}"]
    return "\n".join(lines) + "\n" + rest
