"""The same main job on the Ray backend (a real local Ray, num_cpus=2): every node a Ray actor,
the trainer ranks rendezvous over gloo, and the job ends with its runs finished."""

from __future__ import annotations

import threading
from pathlib import Path

import psutil
import pytest
from mainjob_helpers import run_config, tiny_job
from rich.console import Console

from node_helpers import wait_for
from rlplex.control.job.states import JobState
from rlplex.mainjob.config import load_main_job
from rlplex.mainjob.driver import run_main_job
from rlplex.mainjob.view import collect

ray = pytest.importorskip("ray")


pytestmark = pytest.mark.e2e

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.slow
def test_main_job_runs_on_ray(ray_address: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    path = tmp_path / "job.toml"
    runs = {"run_a": run_config(1, 2), "run_b": run_config(2, 2)}
    path.write_text(tiny_job("mj-ray", out, runs, backend="ray", max_runs=2))
    niceness: list[int] = []

    def node_actors_niceness() -> list[int] | None:
        """The niceness of this pytest's Ray's node actors (children of its raylet, so of this process)."""
        found = []
        for process in psutil.Process().children(recursive=True):
            try:
                if process.name().startswith("ray::NodeActor"):
                    found.append(process.nice())
            except psutil.Error:
                continue  # it ended meanwhile
        niceness[:] = found
        return niceness or None

    watcher = threading.Thread(target=lambda: wait_for(node_actors_niceness, 300, "a node actor"), daemon=True)
    watcher.start()
    state = run_main_job(load_main_job(path), Console(file=open(tmp_path / "console.txt", "w")), live=False)
    watcher.join(timeout=10)
    # Ray's workers run at nice 15 unless told otherwise: starved beside any other work.
    assert niceness and set(niceness) == {0}, niceness
    assert state == JobState.STOPPED, (out / "report.md").read_text()
    view = collect(out)
    assert [(run.run_id, run.state, run.trained_steps) for run in view.runs] == [
        ("run_a", "finished", 2),
        ("run_b", "finished", 2),
    ]
    assert {node.role for node in view.nodes} == {"trainer", "elastic", "orchestrator", "conductor"}
    assert all(node.state == "FINISHED" for node in view.nodes), view.nodes
    assert "## Runs" in (out / "report.md").read_text()
