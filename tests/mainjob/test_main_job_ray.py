"""The same main job on the Ray backend (a real local Ray, num_cpus=2): every node a Ray actor,
the trainer ranks rendezvous over gloo, and the job ends with its runs finished."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from rlplex.control.states import JobState
from rlplex.mainjob.config import load_main_job
from rlplex.mainjob.driver import run_main_job
from rlplex.mainjob.view import collect

ray = pytest.importorskip("ray")

from rlplex.control.ray_scheduler import NAMESPACE  # noqa: E402

SRC = Path(__file__).resolve().parents[2] / "src"
RUN = 'task = "reverse", max_steps = 2, batch_size = 8, group_size = 4, model = { base = { warmup_steps = 20 } }'
JOB = f"""
name = "mj-ray"
output_dir = "OUT_DIR"
backend = "ray"
timeout_s = 400
[trainer]
world_size = 2
max_runs = 2
[[runs]]
id = "run_a"
config = {{ seed = 1, {RUN} }}
[[runs]]
id = "run_b"
config = {{ seed = 2, {RUN} }}
"""


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_main_job_runs_on_ray(ray_session: None, tmp_path: Path) -> None:
    out = tmp_path / "out"
    path = tmp_path / "job.toml"
    path.write_text(JOB.replace("OUT_DIR", str(out)))
    state = run_main_job(load_main_job(path), Console(file=open(tmp_path / "console.txt", "w")), live=False)
    assert state == JobState.STOPPED, (out / "report.md").read_text()
    view = collect(out)
    assert [(run.run_id, run.state, run.trained_steps) for run in view.runs] == [
        ("run_a", "finished", 2),
        ("run_b", "finished", 2),
    ]
    assert {node.role for node in view.nodes} == {"trainer", "elastic", "orchestrator", "conductor"}
    assert all(node.state == "FINISHED" for node in view.nodes), view.nodes
    assert "## Runs" in (out / "report.md").read_text()
