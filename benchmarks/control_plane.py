"""Control-plane latencies and idle cost on the local backend.

    python -m benchmarks.control_plane [--quick]

Goals (issue 3): 16 no-op workers RUNNING <= 3 s; SIGKILL detected <= 1 s; a hung worker
detected within its deadline + 1 s; a lost worker back to RUNNING <= 2 s; a killed master
resumed <= 3 s with no live worker restarted; the idle control plane with 64 workers
<= 2 % of one core (master process CPU time over a window, psutil).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import report
from rlplex.control import JobBuilder, JobSpec, JobState, NodeState, PrimeMaster, SqliteStateStore

IDLE = "rlplex.control:Worker"  # the base Worker: starts, runs until stopped, does nothing
HEARTBEAT_S = 0.5  # the JobSpec default; the idle cost is also measured at 0.2 s


def idle_job(out: Path, count: int, heartbeat_s: float = HEARTBEAT_S, **role: Any) -> JobSpec:
    return (
        JobBuilder("bench", out, capacity={"cpu": 2}, heartbeat_interval_s=heartbeat_s)
        .role("idle", entrypoint=IDLE, count=count, resources={"cpu": 0.01}, **role)
        .build()
    )


def until(master: PrimeMaster, predicate: Callable[[], bool], timeout: float = 30.0) -> float:
    """Step the control loop until `predicate`; returns the wall time when it held."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark condition not reached")
        master.monitor()
        time.sleep(0.005)
    return time.time()


def node(master: PrimeMaster, node_id: str) -> Any:
    return next(n for ns in master.get_nodes_by_role().values() for n in ns if n.node_id == node_id)


def first_transition(master: PrimeMaster, node_id: str, state: str, after: float) -> float:
    return min(r.at for r in master.store.transitions(master.job_id) if r.entity == node_id and r.new == state
               and r.at >= after)  # fmt: skip


def bench_startup(root: Path) -> float:
    start = time.perf_counter()
    with PrimeMaster.create(idle_job(root / "startup", 16)) as master:
        master.start()
        elapsed = time.perf_counter() - start
        assert master.state == JobState.RUNNING
    return elapsed


def bench_sigkill(root: Path) -> tuple[float, float]:
    with PrimeMaster.create(idle_job(root / "sigkill", 4)) as master:
        master.start()
        victim = node(master, "idle-1").pid
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        until(
            master, lambda: node(master, "idle-1").restarts == 1 and node(master, "idle-1").state == NodeState.RUNNING
        )
        detected = first_transition(master, "idle-1", "FAILED", killed) - killed
        running = first_transition(master, "idle-1", "RUNNING", killed) - killed
    return detected, running


def bench_hang(root: Path, timeout_s: float) -> float:
    with PrimeMaster.create(idle_job(root / "hang", 4, heartbeat_timeout_s=timeout_s)) as master:
        master.start()
        hung_at = time.time()
        os.kill(node(master, "idle-2").pid, signal.SIGSTOP)
        until(master, lambda: node(master, "idle-2").restarts == 1)
        return first_transition(master, "idle-2", "FAILED", hung_at) - hung_at


def bench_resume(root: Path) -> tuple[float, int, bool]:
    out = root / "resume"
    job_file = root / "resume.toml"
    job_file.write_text(
        f'name = "resume"\noutput_dir = "{out}"\nheartbeat_interval_s = {HEARTBEAT_S}\ncapacity = {{ cpu = 2 }}\n'
        f'[roles.idle]\ncount = 8\nentrypoint = "{IDLE}"\nresources = {{ cpu = 0.01 }}\n'
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    cli = subprocess.Popen([sys.executable, "-m", "rlplex.cli", "job", "run", str(job_file)], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                store = SqliteStateStore.in_dir(out, create=False)
                job_id = store.latest_job_id()
                if job_id and store.job(job_id).state == "RUNNING":
                    break
                store.close()
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the job under the CLI master did not reach RUNNING")
            time.sleep(0.05)
        before = {n.node_id: n.pid for n in store.nodes(job_id)}
        os.kill(cli.pid, signal.SIGKILL)
        cli.wait()
        start = time.perf_counter()
        master = PrimeMaster.resume(out)
        until(master, lambda: master.state == JobState.RUNNING
              and all(s.connected for s in master.manager.slots.values()))  # fmt: skip
        elapsed = time.perf_counter() - start
        after = {n.node_id: n.pid for ns in master.get_nodes_by_role().values() for n in ns}
        restarts = sum(n.restarts for ns in master.get_nodes_by_role().values() for n in ns)
        master.stop()
        master.close()
        return elapsed, restarts, after == before
    finally:
        if cli.poll() is None:
            cli.kill()


def bench_idle_cpu(root: Path, window_s: float, heartbeat_s: float) -> tuple[float, float]:
    with PrimeMaster.create(idle_job(root / "idle64", 64, heartbeat_s=heartbeat_s)) as master:
        started = time.perf_counter()
        master.start()
        ready_s = time.perf_counter() - started
        me = psutil.Process()
        settle = time.monotonic() + 1.0
        while time.monotonic() < settle:
            master.monitor()
            time.sleep(master.manager.spec.monitor_interval_s)
        cpu0, wall0 = sum(me.cpu_times()[:2]), time.monotonic()
        while time.monotonic() - wall0 < window_s:
            master.monitor()
            time.sleep(master.manager.spec.monitor_interval_s)
        cpu = sum(me.cpu_times()[:2]) - cpu0
        return 100.0 * cpu / (time.monotonic() - wall0), ready_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    hang_timeout = 1.0
    window = 3.0 if args.quick else 10.0
    with tempfile.TemporaryDirectory(prefix="rlplex-bench-") as tmp:
        root = Path(tmp)
        startup = bench_startup(root)
        detect, back = bench_sigkill(root)
        hang = bench_hang(root, hang_timeout)
        resume_s, resume_restarts, same_pids = bench_resume(root)
        idle_pct, idle_ready = bench_idle_cpu(root, window, HEARTBEAT_S)
        idle_fast, _ = bench_idle_cpu(root / "fast", window, 0.2)
    rows = [
        ("16 no-op workers RUNNING (s)", startup, "<= 3"),
        ("SIGKILL detected (s)", detect, "<= 1"),
        (f"hung worker detected (s, deadline {hang_timeout:g} s)", hang, f"<= {hang_timeout + 1:g}"),
        ("lost worker back to RUNNING (s)", back, "<= 2"),
        ("killed master resumed (s)", resume_s, "<= 3"),
        ("  live workers restarted by the resume", resume_restarts, "0"),
        ("  same pids after resume", str(same_pids), "True"),
        (f"idle master CPU, 64 workers, heartbeat {HEARTBEAT_S:g} s (% of a core, {window:g} s)", idle_pct, "<= 2"),
        (f"idle master CPU, 64 workers, heartbeat 0.2 s (% of a core, {window:g} s)", idle_fast, "-"),
        ("  64 workers RUNNING (s)", idle_ready, "-"),
    ]
    figures = {
        "heartbeat_interval_s": HEARTBEAT_S,
        "startup_16_s": startup,
        "sigkill_detect_s": detect,
        "hang_detect_s": hang,
        "hang_deadline_s": hang_timeout,
        "lost_worker_running_s": back,
        "master_resume_s": resume_s,
        "master_resume_restarts": resume_restarts,
        "master_resume_same_pids": same_pids,
        "idle_cpu_percent_64": idle_pct,
        "idle_cpu_percent_64_heartbeat_0.2": idle_fast,
        "startup_64_s": idle_ready,
        "quick": args.quick,
    }
    report("control_plane", "control plane (local backend)", ("figure", "value", "goal"), rows, figures)


if __name__ == "__main__":
    main()
