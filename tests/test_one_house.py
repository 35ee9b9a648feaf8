"""The "one house" promises that a grep can check: one way to spawn the library's own children,
one way to form a torch.distributed group, and the control plane free of torch at import."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "rlplex"


def _calls(attribute: str) -> list[str]:
    """'file:line' of every call `<anything but psutil>.<attribute>(...)` in src/rlplex."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attribute:
                owner = node.func.value
                if not (isinstance(owner, ast.Name) and owner.id == "psutil"):  # inspects, starts nothing
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    return found


def test_children_are_spawned_through_the_process_kernel_only() -> None:
    assert [c.split(":")[0] for c in _calls("get_context")] == ["processes.py"]
    assert [c.split(":")[0] for c in _calls("Process")] == ["processes.py"]


def test_a_torch_distributed_group_is_formed_in_one_place() -> None:
    assert [c.split(":")[0] for c in _calls("init_process_group")] == ["control/elastic/entry.py"]


# What a process that needs no model imports: the CLI, the master of `rlplex run`, and the node
# roles that only coordinate. torch, transformers, vLLM and Ray load where a module uses them.
LIGHT_MODULES = [
    "rlplex",
    "rlplex.cli",
    "rlplex.control",
    "rlplex.processes",
    "rlplex.control.node.runtime",
    "rlplex.control.elastic.worker",
    "rlplex.mainjob.driver",
    "rlplex.mainjob.conductor",
    "rlplex.mainjob.orchestrator_node",
    "rlplex.mainjob.rollout_node",
    "rlplex.mainjob.inference_node",
    "rlplex.multirun.trainer",
    "rlplex.dashboard.server",
]
HEAVY = ("torch", "transformers", "vllm", "ray", "datasets")


def test_the_control_plane_and_the_cli_import_no_heavy_library() -> None:
    code = (
        f"import importlib, sys\nfor name in {LIGHT_MODULES!r}:\n    importlib.import_module(name)\n"
        f"print(' '.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(SRC.parent), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"imported at import time: {result.stdout.strip()}"
