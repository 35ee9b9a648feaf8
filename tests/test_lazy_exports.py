"""Every name a package exports lazily (`rlplex.lazy`) resolves to the module it is mapped to: a
module moved or split without its map updated fails here, not in a user's import."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

LAZY_PACKAGES = [
    "rlplex.control",
    "rlplex.control.elastic",
    "rlplex.models",
    "rlplex.multirun",
    "rlplex.multirun.trainer",
]


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_every_lazy_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    names = list(getattr(module, "__all__", []))
    assert names, f"{package} exports nothing"
    missing = []
    for name in names:
        try:
            getattr(module, name)
        except (AttributeError, ImportError) as error:
            missing.append(f"{name}: {error}")
    assert missing == []


def test_the_list_of_lazy_packages_is_complete() -> None:
    src = Path(importlib.import_module("rlplex").__file__ or "").parent
    found = sorted(
        ".".join(("rlplex", *path.parent.relative_to(src).parts))
        for path in src.rglob("__init__.py")
        if "lazy_getattr" in path.read_text()
    )
    assert found == sorted(LAZY_PACKAGES)
