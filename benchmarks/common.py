"""Shared output helpers for benchmarks: a rich table on stdout and a JSON file."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

RESULTS = Path("bench_results")


def machine() -> dict[str, Any]:
    import os

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def report(
    name: str, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], figures: dict[str, Any]
) -> Path:
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(f"{v:,.3f}" if isinstance(v, float) else str(v) for v in row))
    Console().print(table)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **figures}, indent=2))
    print(f"wrote {path}")
    return path
