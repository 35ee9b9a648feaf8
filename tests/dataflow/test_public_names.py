"""The dataflow names the README promises are importable from `rlplex.dataflow` (issue 14)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import rlplex.dataflow

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# The README's dataflow row and layout line name some parts in words ("MFC graph", "data plane"):
# these are the classes those words stand for, plus the names in its code sample.
NAMED_IN_WORDS = [
    "MFCGraph",
    "MFCDef",
    "DataPlane",
    "SequenceBuffer",
    "FunctionExecutor",
    "StreamDataset",
    "StalenessController",  # "bounded staleness (eta)"
    "ModelWorkerNode",
    "JobModelWorker",
    "ProcessModelWorker",
    "ModelInterfaceType",
]


def readme_dataflow_names() -> set[str]:
    """Class-like names in the README's dataflow status row and its `dataflow/` layout line."""
    lines = [
        line
        for line in README.read_text().splitlines()
        if line.startswith("| dataflow |") or line.lstrip().startswith("dataflow/")
    ]
    assert len(lines) == 2, "the README's dataflow row or layout line moved; update this test"
    return {name for line in lines for name in re.findall(r"\b[A-Z][a-z]+(?:[A-Z][A-Za-z]*)+\b", line)}


def test_readme_dataflow_names_import_from_the_package() -> None:
    names = readme_dataflow_names() | set(NAMED_IN_WORDS)
    assert "StreamDataset" in names
    missing = sorted(name for name in names if not hasattr(rlplex.dataflow, name))
    assert not missing, f"named in README.md but not importable from rlplex.dataflow: {missing}"
    assert names <= set(rlplex.dataflow.__all__)
    namespace: dict[str, object] = {}
    exec(f"from rlplex.dataflow import {', '.join(sorted(names))}", namespace)  # the import users write
    assert all(name in namespace for name in names)


def test_dataflow_imports_no_higher_layer() -> None:
    # Layers: control < dataflow < runners/multirun < CLI. A fresh interpreter shows what the
    # package import pulls in, unaffected by what other tests imported.
    code = (
        "import sys, rlplex.dataflow; "
        "print(' '.join(m for m in sys.modules if m.split('.')[:2] in "
        "(['rlplex', 'runners'], ['rlplex', 'multirun'], ['rlplex', 'mainjob'], ['rlplex', 'cli'])))"
    )
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, env=env
    )
    assert result.stdout.split() == []
