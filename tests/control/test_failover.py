"""Master failover through the CLI: SIGKILL the master, `rlplex job resume`, the job goes on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from cli_helpers import rlplex_in_process
from node_helpers import node_processes, wait_for
from rlplex.control import JobState, PrimeMaster, SqliteStateStore
from timing import scaled

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent

JOB = """
name = "failover"
output_dir = "{out}"
heartbeat_interval_s = 0.1
capacity = {{ cpu = 2 }}
[roles.counter]
count = 3
entrypoint = "control_workers:Counter"
resources = {{ cpu = 0.5 }}
config = {{ items = 90, delay_s = 0.04, hold_until = "{hold}" }}
"""


# Nodes hold after 3 items until this file exists, so that none can finish before the master
# is killed however slow the machine is.
RELEASE = "release_nodes"


def rlplex(*args: str, env: dict[str, str]) -> list[str]:
    return [sys.executable, "-m", "rlplex.cli", "job", *args]


@contextmanager
def started_master(
    job_dir: Path, env: dict[str, str], argv: list[str] | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], SqliteStateStore, str]]:
    """`rlplex job run` (or `argv` + the job file) in a subprocess, given once every node is RUNNING
    and has made progress; killed on the way out if it still runs."""
    job_file = job_dir.parent / "job.toml"
    job_file.write_text(JOB.format(out=job_dir, hold=RELEASE))
    command = rlplex("run", str(job_file), env=env) if argv is None else [*argv, str(job_file)]
    master = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: (job_dir / "job.sqlite").exists(), 30, "the job's store")
    store = SqliteStateStore.in_dir(job_dir, create=False)

    def progressed() -> bool:
        job_id = store.latest_job_id()
        if job_id is None or store.job(job_id).state != "RUNNING":
            return False
        return all(n.state == "RUNNING" and n.progress.get("items", 0) >= 3 for n in store.nodes(job_id))

    wait_for(progressed, 30, "every node RUNNING with progress")
    job_id = store.latest_job_id()
    assert job_id is not None
    try:
        yield master, store, job_id
    finally:
        if master.poll() is None:
            master.kill()
            master.wait()


def resume(job_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`rlplex job resume`, which must end the job cleanly."""
    resumed = subprocess.run(rlplex("resume", str(job_dir), env=env), env=env, capture_output=True, text=True,
                             timeout=60)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    return resumed


def test_killed_master_is_resumed_without_restarting_live_nodes(job_dir: Path, child_env: dict[str, str]) -> None:
    with started_master(job_dir, child_env) as (master, store, job_id):
        before = {n.node_id: n.pid for n in store.nodes(job_id)}
        os.kill(master.pid, signal.SIGKILL)
        master.wait(timeout=scaled(10))
        assert all(p.is_running() for p in node_processes(job_dir)) and len(node_processes(job_dir)) == 3
        (job_dir / RELEASE).touch()

        resumed = resume(job_dir, child_env)
        assert f"job {job_id}: FINISHED" in resumed.stdout  # its work done: not "STOPPED" (issue 32, hole 6)
        job = store.job(job_id)
        assert job.state == "STOPPED" and job.restarts == 0
        after = store.nodes(job_id)
        assert {n.node_id: n.pid for n in after} == before
        assert all(n.restarts == 0 and n.state == "FINISHED" for n in after)
        done = {int(x) for f in (job_dir / "items").glob("*.txt") for x in f.read_text().split()}
        assert done == set(range(90))
        job_steps = [r.new for r in store.transitions(job_id) if r.entity == "job"]
        assert job_steps == ["READY", "RUNNING", "READY", "RUNNING", "STOPPING", "STOPPED"]
        # The failover is an event of its own (the dashboard's log, the report), naming both masters.
        ((action, target, cause),) = [(d.old, d.entity, d.cause) for d in store.decisions(job_id)]
        assert (action, target) == ("FAILOVER", "master") and f"took over from pid {master.pid};" in cause
        assert "3 of 3 nodes to reattach" in cause and str(job.master_pid) in cause

        status = subprocess.run(rlplex("status", str(job_dir), env=child_env), env={**child_env, "COLUMNS": "200"},
                                capture_output=True, text=True, timeout=30)  # fmt: skip
        assert status.returncode == 0
        # The final progress: nodes that ended before the resume deliver it in their final message
        # (see the next test); the whole table is shown on failure.
        assert "FINISHED" in status.stdout and "counter" in status.stdout and "items=30" in status.stdout, status.stdout


def test_nodes_that_finished_without_a_master_give_the_resumed_master_their_final_progress(
    job_dir: Path, child_env: dict[str, str]
) -> None:
    """Nodes that end while no master runs wait to deliver their final message (state, progress,
    error). The resumed master must take their verdict from it, not from the status call it
    re-attaches with, or the job is judged done before it arrives and keeps the stale progress."""
    with started_master(job_dir, child_env) as (master, store, job_id):
        os.kill(master.pid, signal.SIGKILL)
        master.wait(timeout=scaled(10))
        (job_dir / RELEASE).touch()

        def all_items_written() -> bool:
            return sum(len(f.read_text().split()) for f in (job_dir / "items").glob("*.txt")) == 90

        wait_for(all_items_written, 60, "every node to finish its items with no master")
        resume(job_dir, child_env)
        nodes = store.nodes(job_id)
        assert {n.node_id: (n.state, n.progress.get("items")) for n in nodes} == {
            f"counter-{rank}": ("FINISHED", 30) for rank in range(3)
        }


def test_master_failover_during_a_worker_failure(job_dir: Path, child_env: dict[str, str]) -> None:
    """The master and a worker die together: the resumed master restarts only the lost worker."""
    with started_master(job_dir, child_env) as (master, store, job_id):
        before = {n.node_id: n.pid for n in store.nodes(job_id)}
        os.kill(master.pid, signal.SIGKILL)
        os.kill(before["counter-0"], signal.SIGKILL)
        master.wait(timeout=scaled(10))
        (job_dir / RELEASE).touch()
        resume(job_dir, child_env)
        nodes = {n.node_id: n for n in store.nodes(job_id)}
        assert nodes["counter-0"].restarts == 1 and nodes["counter-0"].pid != before["counter-0"]
        assert {k: (n.pid, n.restarts) for k, n in nodes.items() if k != "counter-0"} == {
            k: (pid, 0) for k, pid in before.items() if k != "counter-0"
        }
        assert store.job(job_id).state == "STOPPED"
        failover, (action, target, cause) = [(d.old, d.entity, d.cause) for d in store.decisions(job_id)]
        assert failover[:2] == ("FAILOVER", "master") and "3 of 3 nodes to reattach" in failover[2], failover
        assert (action, target) == ("RESTART_WORKER", "counter-0") and "process exited" in cause
        done = {int(x) for f in (job_dir / "items").glob("*.txt") for x in f.read_text().split()}
        assert done == set(range(90))


def test_a_second_master_for_a_live_job_is_refused(job_dir: Path, child_env: dict[str, str]) -> None:
    """`rlplex job resume` or `run` while the job's master lives: exit 2, one line naming the live master;
    the live job's token, store and nodes are untouched and it finishes alone."""
    with started_master(job_dir, child_env) as (master, store, job_id):
        token = (job_dir / "job.token").read_text()
        before = {n.node_id: (n.pid, n.incarnation) for n in store.nodes(job_id)}
        for args in (("resume", str(job_dir)), ("run", str(job_dir.parent / "job.toml"))):
            second = subprocess.run(rlplex(*args, env=child_env), env={**child_env, "COLUMNS": "300"},
                                    capture_output=True, text=True, timeout=30)  # fmt: skip
            assert second.returncode == 2, (args, second.stdout, second.stderr)
            lines = second.stdout.strip().splitlines()
            assert len(lines) == 1 and "already has a live master" in lines[0], lines
            assert f"pid {master.pid} on " in lines[0]
        assert (job_dir / "job.token").read_text() == token
        assert store.latest_job_id() == job_id and store.job(job_id).master_pid == master.pid
        (job_dir / RELEASE).touch()
        assert master.wait(timeout=scaled(60)) == 0
        assert store.job(job_id).state == "STOPPED"
        assert {n.node_id: (n.pid, n.incarnation) for n in store.nodes(job_id)} == before
        assert store.decisions(job_id) == []


@pytest.mark.parametrize("point", ["in-decision", "before-launch"])
def test_a_master_killed_halfway_through_a_restart_is_resumed_and_the_job_finishes(
    job_dir: Path, child_env: dict[str, str], point: str
) -> None:
    """A restart decision is one transaction (killed inside it: nothing of it is stored, the resumed
    master decides again); a decided restart whose launch was not recorded is re-done on resume."""
    argv = [sys.executable, str(HERE / "dying_master.py"), point]
    with started_master(job_dir, child_env, argv=argv) as (master, store, job_id):
        victim = next(n for n in store.nodes(job_id) if n.node_id == "counter-1")
        os.kill(victim.pid, signal.SIGKILL)
        assert master.wait(timeout=scaled(30)) == -signal.SIGKILL  # it died at `point`
        (job_dir / RELEASE).touch()
        with PrimeMaster.resume(job_dir) as resumed:
            assert resumed.wait(timeout=scaled(40)) == JobState.STOPPED
        done = {int(x) for f in (job_dir / "items").glob("*.txt") for x in f.read_text().split()}
        assert done == set(range(90))
        nodes = {n.node_id: n for n in store.nodes(job_id)}
        assert nodes["counter-1"].restarts == 1 and nodes["counter-1"].state == "FINISHED"
        assert nodes["counter-0"].restarts == 0 and nodes["counter-2"].restarts == 0
        assert store.job(job_id).restarts == 1  # one restart, paid once
        decided = sorted((d.old, d.entity) for d in store.decisions(job_id))
        assert decided == [("FAILOVER", "master"), ("RESTART_WORKER", "counter-1")]
        steps = [(r.old, r.new) for r in store.transitions(job_id) if r.entity == "counter-1"]
        if point == "in-decision":  # nothing of the first decision was stored: the resumed master decided anew
            assert steps[3:] == [("RUNNING", "FAILED"), ("FAILED", "PENDING"), ("PENDING", "CREATED"),
                                 ("CREATED", "CHECKED"), ("CHECKED", "RUNNING"), ("RUNNING", "FINISHED")]  # fmt: skip
            assert nodes["counter-1"].incarnation == 1
        else:  # decided and stored; the resumed master launched it under a fresh incarnation
            assert ("PENDING", "PENDING") in steps and nodes["counter-1"].incarnation == 2


def test_a_finished_node_keeps_its_result_until_a_master_has_stored_it(
    job_dir: Path, child_env: dict[str, str]
) -> None:
    """The nodes finish while their master is frozen (SIGSTOP), then the master is killed: they wait
    for an acknowledgement, tell the resumed master, and nothing runs again."""
    with started_master(job_dir, child_env) as (master, store, job_id):
        before = {n.node_id: n.pid for n in store.nodes(job_id)}
        os.kill(master.pid, signal.SIGSTOP)
        (job_dir / RELEASE).touch()

        def all_items() -> bool:
            return sum(len(f.read_text().split()) for f in (job_dir / "items").glob("*.txt")) == 90

        wait_for(all_items, 30, "every item processed")
        # Their final messages sit unread in the frozen master's socket: no node may give up on them.
        _gone, alive = psutil.wait_procs(node_processes(job_dir), timeout=3.0)
        assert len(alive) == 3, "a node exited without an acknowledgement of its final message"
        os.kill(master.pid, signal.SIGKILL)
        master.wait(timeout=scaled(10))
        resume(job_dir, child_env)
        assert store.job(job_id).state == "STOPPED"
        assert [(d.old, d.entity) for d in store.decisions(job_id)] == [("FAILOVER", "master")]
        after = store.nodes(job_id)
        assert {n.node_id: n.pid for n in after} == before
        assert all(n.state == "FINISHED" and n.restarts == 0 for n in after)
        assert node_processes(job_dir) == []


def test_cli_user_errors_are_one_line_with_exit_code_2(tmp_path: Path, child_env: dict[str, str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(f'name = "x"\noutput_dir = "{tmp_path}"\n[roles.w]\ncount = -1\nentrypoint = "m:f"\n')
    for args in (("run", str(bad)), ("status", str(tmp_path / "none")), ("resume", str(tmp_path / "none"))):
        result = subprocess.run(rlplex(*args, env=child_env), env={**child_env, "COLUMNS": "300"},
                                capture_output=True, text=True, timeout=30)  # fmt: skip
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert result.stdout.startswith("error:") and len(result.stdout.strip().splitlines()) <= 3
    result = subprocess.run(rlplex("run", str(bad), env=child_env), env={**child_env, "COLUMNS": "300"},
                            capture_output=True, text=True, timeout=30)  # fmt: skip
    assert "roles.w.count" in result.stdout


def job_cause(store: SqliteStateStore, job_id: str) -> str:
    return " | ".join(r.cause for r in store.transitions(job_id) if r.entity == "job")


@contextmanager
def _killing_nodes_of(job_dir: Path) -> Iterator[None]:
    try:
        yield
    finally:
        for process in node_processes(job_dir):
            process.kill()


def test_job_stop_stops_a_running_job_and_takes_over_one_whose_master_died(
    job_dir: Path, child_env: dict[str, str]
) -> None:
    """Issue 32, hole 8: `rlplex job stop` beside `rlplex stop`; the nodes hold, so only a stop ends the job."""
    with started_master(job_dir, child_env) as (master, store, job_id):
        stop = subprocess.run(rlplex("stop", str(job_dir), env=child_env), env=child_env, capture_output=True,
                              text=True, timeout=scaled(60))  # fmt: skip
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert f"job {job_id}: STOPPED" in stop.stdout
        assert master.wait(timeout=scaled(30)) == 0  # `job run` ended with the job, as stopped
        assert store.job(job_id).state == "STOPPED" and "`rlplex job stop`" in job_cause(store, job_id)
        assert node_processes(job_dir) == [] and not (job_dir / "requests" / "stop").exists()
    second = job_dir.parent / "second"
    with started_master(second, child_env) as (master, store, job_id), _killing_nodes_of(second):
        os.kill(master.pid, signal.SIGKILL)
        master.wait(timeout=scaled(10))
        # In this process (the command's real subprocess ran above): it takes the master over.
        stop = rlplex_in_process("job", "stop", str(second))
        assert stop.returncode == 0 and f"job {job_id}: STOPPED" in stop.stdout, stop.stdout + stop.stderr
        assert "master was gone" in job_cause(store, job_id) and node_processes(second) == []
        again = rlplex_in_process("job", "stop", str(second))
        assert again.returncode == 0 and "nothing to stop" in again.stdout, again.stdout + again.stderr
