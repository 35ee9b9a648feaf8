"""A module a test job preloads: it appends the pid of each process that imports it to the file
RLPLEX_TEST_PRELOAD_PROBE names (one line when only the node fork server imported it)."""

from __future__ import annotations

import os

_path = os.environ.get("RLPLEX_TEST_PRELOAD_PROBE")
if _path:
    with open(_path, "a") as _file:
        _file.write(f"{os.getpid()}\n")
