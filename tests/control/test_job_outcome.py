"""A job's end as users read it (issue 32, hole 6): FINISHED when its work is done, STOPPED and by
whom when someone stopped it, FAILED; the store keeps STOPPED for both ends."""

from __future__ import annotations

from rlplex.control.job.states import JobState, WorkDone, job_outcome


def test_a_finished_job_is_not_a_stopped_one() -> None:
    assert job_outcome(JobState.STOPPED, WorkDone.DRIVERS_FINISHED) == "FINISHED"
    assert job_outcome(JobState.STOPPED, WorkDone.NODES_FINISHED) == "FINISHED"
    assert job_outcome(JobState.STOPPED, "every node finished") == "FINISHED"  # as the store gives it back
    assert job_outcome(JobState.STOPPED, "stopped by SIGINT") == "STOPPED by SIGINT"
    assert job_outcome(JobState.STOPPED, "stopped by `rlplex stop`") == "STOPPED by `rlplex stop`"
    assert job_outcome(JobState.STOPPED, "master exiting") == "STOPPED (master exiting)"
    assert job_outcome(JobState.FAILED, "node x failed") == "FAILED"
    assert job_outcome(JobState.RUNNING, "") == "RUNNING"
