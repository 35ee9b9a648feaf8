"""Elastic training on the Ray backend (real local Ray, num_cpus=2): the same roles as on the local
backend; a node actor SIGKILLed mid-training is restarted, re-rendezvoused, and the script resumes."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from test_elastic import CKPT_EVERY, STEPS, elastic_job, job_processes, progress, restart_causes, result

from node_helpers import wait_for
from rlplex.control import JobState, PrimeMaster, parse_job
from rlplex.control.elastic.master import read_elastic_status
from timing import scaled

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"

ray = pytest.importorskip("ray")


pytestmark = pytest.mark.e2e


@pytest.mark.slow
def test_elastic_job_on_ray_recovers_from_a_killed_node_actor(ray_address: str, job_dir: Path) -> None:
    local = elastic_job(job_dir, step_delay=0.02, node_check=False)
    spec = parse_job(local.model_dump(mode="json") | {"backend": "ray"})
    with PrimeMaster.create(spec) as master:
        master.start()
        wait_for(lambda: master.monitor() and progress(job_dir, "trainer-1").get("step", 0) >= CKPT_EVERY + 2, 60,
                 "rank 1 past step 12")  # fmt: skip
        victim = next(n for n in master.get_nodes_by_role()["trainer"] if n.node_id == "trainer-1")
        os.kill(victim.pid, signal.SIGKILL)  # the actor's process: its script dies with it
        assert master.wait(timeout=scaled(90)) == JobState.STOPPED
        done = result(job_dir)
        assert done["steps"] == STEPS and done["restarts"] == 1 and done["world"] == 2, restart_causes(job_dir)
        assert done["resumed_from"] >= CKPT_EVERY and done["final_loss"] < 0.1
        status = read_elastic_status(job_dir)
        assert [r["world"] for r in status["rounds"]] == [2, 2] and status["members"]["trainer-1"]["incarnation"] == 1
    assert job_processes(job_dir) == []
