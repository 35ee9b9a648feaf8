"""The dashboard in headless Chromium on a job folder as a running job leaves it: the runs and
their curves appear, a step logged reaches the page without a reload, an eviction asks for
confirmation, then goes through `rlplex runs evict`'s function, and so does adding a run from a
local TOML file (`rlplex runs add`'s). (The dashboard of a real running
main job, with a SIGKILLed orchestrator: test_main_job_faults.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmarks.dashboard_latency import append_step, make_job
from dashboard_browser import RUN_TOML, Master, answer_one_add, browser_missing, open_dashboard

from rlplex.mainjob.registry import read_registry
from rlplex.multirun.rundir import RunDir
from timing import wait_for

pytestmark = pytest.mark.skipif(browser_missing() is not None, reason=str(browser_missing()))


def test_the_page_follows_the_folder_and_evicts_and_adds_only_once_confirmed(tmp_path: Path) -> None:
    out = tmp_path / "job"
    ids = make_job(out, runs=3, steps=20, max_steps=40)
    with open_dashboard(out, tmp_path / "dashboard.log", "--allow-actions") as dashboard:
        page = dashboard.page
        rows = dashboard.wait("three runs", lambda rows: sorted(rows) == ids, 30)
        assert rows["run_00"] == {"state": "running", "points": "20", "restarts": "0"}
        assert page.get_attribute("#curves", "data-points") == "60" and page.locator("#curves canvas").count() == 1
        append_step(out, 0, "run_00", 20)
        dashboard.wait("run_00's new point", lambda rows: rows["run_00"]["points"] == "21", 10)
        row = page.locator('#runs tr[data-run="run_01"]')
        row.get_by_role("button", name="Evict…").click()
        page.get_by_role("button", name="Cancel").click()  # asked, and refused: nothing happens
        row.get_by_role("button", name="Evict…").click()
        page.fill("#confirm-reason", "from the browser")
        page.get_by_role("button", name="Confirm").click()
        wait_for(lambda: RunDir(out / "runs", "run_01").eviction_reason(), 10, "run_01's eviction")
        assert RunDir(out / "runs", "run_01").eviction_reason() == "from the browser"
        assert not RunDir(out / "runs", "run_00").is_evicted()
        dashboard.wait("run_01 evicted", lambda rows: rows["run_01"]["state"] == "evicted", 10)
        page.locator("#events tr", has_text="run_01 evicted").wait_for()
        # A run from a local file: the page reads it into the form, and asks before it adds.
        assert page.locator("#add-run").is_visible()
        page.set_input_files("#add-file", {"name": "late.toml", "mimeType": "text/plain", "buffer": RUN_TOML.encode()})
        page.wait_for_function("document.getElementById('add-toml').value.includes('max_steps = 2')")
        assert page.input_value("#add-id") == "run_late"  # `rlplex runs add`'s run_<file stem>
        page.get_by_role("button", name="Add the run…").click()
        page.get_by_role("button", name="Cancel").click()
        assert not (out / "requests").exists()
        master = Master()
        thread = answer_one_add(out, master)
        page.get_by_role("button", name="Add the run…").click()
        page.get_by_role("button", name="Confirm").click()
        page.locator("#messages li", has_text="accepted by the job: run_late added as orchestrator rank 3").wait_for()
        thread.join(10)
        assert [entry.id for entry in read_registry(out)] == [*ids, "run_late"]
        assert master.scaled == [("orchestrator", 4)]
