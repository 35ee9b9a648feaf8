"""Rows of the runs' progress CSVs, parsed once: each read parses only the lines appended since
the last one.

Every `collect()` reads every run's `progress.csv` and `logs/trainer_progress.csv` (and its
evaluations'); the live view does so twice a second and the dashboard once a second. With 16
runs of 1,000 steps, parsing them whole took 0.2-0.3 s of a core per collect, 90 % of it in
`csv` and float conversion, so the parsed rows are kept per path with the text they came from.
The file is still read whole (a few ms; `read_regular_text` keeps its checks against FIFOs and
links); when it starts with the text parsed last time, only the rest is parsed. Anything else
(a rewritten or truncated file, a new header) is parsed afresh.
"""

from __future__ import annotations

import csv
import io
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from rlplex.io.safe_files import read_regular_text

MAX_PROGRESS_BYTES = 256 << 20
# Paths whose rows are kept (the least recently read go first): three files per run.
CACHED_FILES = 1024


@dataclass
class _Parsed:
    text: str  # the complete lines parsed so far, header included
    fieldnames: list[str]
    rows: list[dict[str, float]]


_cache: OrderedDict[str, _Parsed] = OrderedDict()
# The master's live view and the dashboard's server thread may collect at once.
_lock = threading.Lock()


def _parse(lines: str, fieldnames: list[str] | None) -> tuple[list[str], list[dict[str, float]]]:
    reader = csv.DictReader(io.StringIO(lines), fieldnames=fieldnames)
    rows = []
    for raw in reader:
        try:
            rows.append({k: float(v) for k, v in raw.items() if k and v not in ("", None)})
        except (TypeError, ValueError):
            continue
    return list(reader.fieldnames or []), rows


def read_progress_rows(path: Path) -> list[dict[str, float]]:
    """Rows of a progress CSV that parse as numbers; a last line still being written is skipped.
    The list is the caller's; its rows are shared with later reads and must not be changed."""
    try:
        text = read_regular_text(path, MAX_PROGRESS_BYTES)
    except OSError:  # missing, or not a regular file (a FIFO would block the live view)
        with _lock:
            _cache.pop(str(path), None)
        return []
    complete = text[: text.rfind("\n") + 1]
    key = str(path)
    with _lock:
        known = _cache.get(key)
        if known is not None and known.fieldnames and complete.startswith(known.text):
            _, added = _parse(complete[len(known.text) :], known.fieldnames)
            parsed = _Parsed(complete, known.fieldnames, known.rows + added)
        else:
            fieldnames, rows = _parse(complete, None)
            parsed = _Parsed(complete, fieldnames, rows)
        _cache[key] = parsed
        _cache.move_to_end(key)
        while len(_cache) > CACHED_FILES:
            _cache.popitem(last=False)
        return list(parsed.rows)


def clear_cache() -> None:
    """Forget every parsed file (a benchmark's cold start)."""
    with _lock:
        _cache.clear()
