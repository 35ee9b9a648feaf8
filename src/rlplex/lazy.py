"""A package's names resolved on first use (PEP 562): importing the package stays cheap, and a
process that needs one module (a node, a trainer rank, `rlplex status`) loads only that one."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """The package's `__getattr__`: `where` maps each exported name to the module, relative to
    `package`, that defines it. A name found once is kept on the package."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
