"""Model folders that rlplex builds once and then finds: locked, written atomically, keyed by settings.

`build_cached(out, ...)` is how `rlplex model tiny` and `rlplex model gguf` write a
`save_pretrained` folder: a second call with the same settings returns at once; a folder built
with other settings is refused rather than replaced under a job that may be reading it (unless
`replace`); a folder that rlplex did not build is never touched. Two processes asking at once
serialise on a lock file beside the folder; the model is built in a hidden sibling and renamed
into place, so a reader never sees half of it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rlplex.errors import ConfigError


@contextmanager
def locked_folder(out: Path) -> Iterator[None]:
    """Hold an exclusive lock beside `out` (released when the file closes, also if this process dies)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_folder(out: Path, build: Callable[[Path], None]) -> None:
    """Run `build` into a hidden sibling and rename it to `out` (absent or empty): a reader never
    sees half a model. Call it under `locked_folder(out)`."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        build(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_settings(out_dir: Path, settings_file: str) -> dict[str, Any] | None:
    """The settings rlplex wrote beside a model it built (`{"key": ..., "settings": {...}}`), or None."""
    try:
        data = json.loads((Path(out_dir) / settings_file).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def build_cached(
    out_dir: str | Path,
    settings_file: str,
    key: str,
    settings: dict[str, Any],
    build: Callable[[Path], None],
    replace: bool = False,
    what: str = "model",
) -> Path:
    """Build the folder `out_dir` with `build(tmp)` unless it already holds these settings (same
    `key`); write `settings_file` beside the model; return its absolute path.

    `replace`: a folder of the same kind built with other settings is rebuilt; one that is not of
    this kind is never touched."""
    out = Path(out_dir).expanduser().resolve()
    with locked_folder(out):
        existing = read_settings(out, settings_file)
        if existing is not None and existing.get("key") == key:
            return out
        if existing is not None and replace:
            shutil.rmtree(out)
        elif out.exists() and (not out.is_dir() or any(out.iterdir())):
            held = f"a {what} built with other settings" if existing else f"something that is not a {what}"
            raise ConfigError(f"{out}: holds {held}; build into another folder (or delete this one, or --replace)")

        def build_and_record(tmp: Path) -> None:
            build(tmp)
            record = {"key": key, "settings": settings}
            (tmp / settings_file).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")

        build_folder(out, build_and_record)
    return out


__all__ = ["build_cached", "build_folder", "locked_folder", "read_settings"]
