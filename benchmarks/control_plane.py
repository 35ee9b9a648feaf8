"""Control-plane latencies and idle cost, local backend and Ray backend side by side.

    python -m benchmarks.control_plane [--quick] [--backend local|ray|both]

Ray runs locally (`ray.init(num_cpus=2)`, started once, before any timing); on Ray the killed
master is the master actor, which Ray restarts and which resumes the job. The idle CPU is
taken with the 16 workers of the start-up job on both backends, and with 64 workers on the
local backend only (64 Ray actors are 64 Python processes of ~150 MB each).

Goals (issue 3): 16 no-op workers RUNNING <= 3 s; SIGKILL detected <= 1 s; a hung worker
detected within its deadline + 1 s; a lost worker back to RUNNING <= 2 s; a killed master
resumed <= 3 s with no live worker restarted; the idle control plane with 64 workers
<= 2 % of one core (master process CPU time over a window, psutil; the node processes' CPU
is reported beside it).
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


def idle_job(out: Path, count: int, heartbeat_s: float = HEARTBEAT_S, backend: str = "local", **role: Any) -> JobSpec:
    return (
        JobBuilder("bench", out, backend=backend, capacity={"cpu": 2}, heartbeat_interval_s=heartbeat_s)
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


def _cpu_s(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _drive(master: PrimeMaster, seconds: float) -> None:
    """Run the master's control loop for `seconds`, as `wait()` does."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        master.monitor()
        time.sleep(master.manager.spec.monitor_interval_s)


def idle_cpu(master: PrimeMaster, window_s: float) -> tuple[float, float]:
    """(% of one core) of the master process, and of all its node processes together, while the
    master watches idle nodes, after 1 s to settle. The master's figure is the goal's: the nodes'
    share is their heartbeat thread plus the idle user worker, reported beside it."""
    me = psutil.Process()
    _drive(master, 1.0)
    nodes = me.children(recursive=True)
    cpu0, nodes0, wall0 = _cpu_s([me]), _cpu_s(nodes), time.monotonic()
    _drive(master, window_s)
    wall = time.monotonic() - wall0
    return 100.0 * (_cpu_s([me]) - cpu0) / wall, 100.0 * (_cpu_s(nodes) - nodes0) / wall


def bench_startup(root: Path, backend: str, window_s: float) -> tuple[float, float]:
    """Seconds until 16 no-op workers run, then the idle master's CPU with them."""
    start = time.perf_counter()
    with PrimeMaster.create(idle_job(root / f"startup-{backend}", 16, backend=backend)) as master:
        master.start()
        elapsed = time.perf_counter() - start
        assert master.state == JobState.RUNNING
        return elapsed, idle_cpu(master, window_s)[0]


def bench_sigkill(root: Path, backend: str) -> tuple[float, float]:
    with PrimeMaster.create(idle_job(root / f"sigkill-{backend}", 4, backend=backend)) as master:
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


def bench_hang(root: Path, timeout_s: float, backend: str) -> float:
    job = idle_job(root / f"hang-{backend}", 4, backend=backend, heartbeat_timeout_s=timeout_s)
    with PrimeMaster.create(job) as master:
        master.start()
        hung_at = time.time()
        os.kill(node(master, "idle-2").pid, signal.SIGSTOP)
        until(master, lambda: node(master, "idle-2").restarts == 1)
        return first_transition(master, "idle-2", "FAILED", hung_at) - hung_at


def bench_resume_ray(root: Path) -> tuple[float, int, bool]:
    """SIGKILL the master actor; seconds until its next incarnation runs the job with every node re-attached."""
    from rlplex.control.backends.ray_master import RayMasterHandle

    out = root / "resume-ray"
    handle = RayMasterHandle.launch(idle_job(out, 8, backend="ray"))
    try:
        deadline = time.monotonic() + 60
        while not ((info := handle.info())["state"] == "RUNNING" and info.get("connected") == 8):
            if time.monotonic() > deadline:
                raise TimeoutError("the job under the master actor did not reach RUNNING")
            time.sleep(0.02)
        store = SqliteStateStore.in_dir(out, create=False)
        job_id = str(info["job_id"])
        before = {n.node_id: n.pid for n in store.nodes(job_id)}
        start = time.perf_counter()
        os.kill(int(info["pid"]), signal.SIGKILL)
        while True:
            try:
                info = handle.info(timeout_s=5.0)
            except Exception:  # the actor is being restarted
                info = {}
            if (
                info.get("resumed")
                and info.get("state") == "RUNNING"
                and info.get("connected") == 8
                and not info.get("failover_pending")
            ):
                break
            if time.monotonic() > deadline + 60:
                raise TimeoutError("the master actor did not resume")
            time.sleep(0.01)
        elapsed = time.perf_counter() - start
        after = {n.node_id: n.pid for n in store.nodes(job_id)}
        restarts = sum(n.restarts for n in store.nodes(job_id))
        store.close()
        return elapsed, restarts, after == before
    finally:
        handle.close()


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


def bench_idle_cpu(root: Path, window_s: float, heartbeat_s: float) -> tuple[float, float, float]:
    """(master % of a core, the 64 nodes' % together, seconds to RUNNING)."""
    with PrimeMaster.create(idle_job(root / "idle64", 64, heartbeat_s=heartbeat_s)) as master:
        started = time.perf_counter()
        master.start()
        ready_s = time.perf_counter() - started
        return (*idle_cpu(master, window_s), ready_s)


def start_ray() -> None:
    import ray

    src = str(Path(__file__).resolve().parents[1] / "src")
    path = os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])
    from rlplex.control.backends.ray import LOCAL_RAY_SYSTEM_CONFIG

    ray.init(num_cpus=2, include_dashboard=False, namespace="rlplex", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}}, _system_config=LOCAL_RAY_SYSTEM_CONFIG)  # fmt: skip


def run_backend(root: Path, backend: str, hang_timeout: float, window_s: float) -> dict[str, Any]:
    startup, idle16 = bench_startup(root, backend, window_s)
    detect, back = bench_sigkill(root, backend)
    hang = bench_hang(root, hang_timeout, backend)
    resume_s, resume_restarts, same_pids = (bench_resume if backend == "local" else bench_resume_ray)(root)
    return {
        "startup_16_s": startup,
        "idle_cpu_percent_16": idle16,
        "sigkill_detect_s": detect,
        "hang_detect_s": hang,
        "lost_worker_running_s": back,
        "master_resume_s": resume_s,
        "master_resume_restarts": resume_restarts,
        "master_resume_same_pids": same_pids,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--backend", choices=["local", "ray", "both"], default="both")
    args = parser.parse_args()
    backends = ["local", "ray"] if args.backend == "both" else [args.backend]
    hang_timeout = 1.0
    window = 3.0 if args.quick else 10.0
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="rlplex-bench-") as tmp:
        root = Path(tmp)
        if "ray" in backends:
            start_ray()
        for backend in backends:
            results[backend] = run_backend(root, backend, hang_timeout, window)
        if "local" in backends:
            idle_pct, idle_nodes, idle_ready = bench_idle_cpu(root, window, HEARTBEAT_S)
            idle_fast, _, _ = bench_idle_cpu(root / "fast", window, 0.2)
            results["local"].update(
                {
                    "idle_cpu_percent_64": idle_pct,
                    "idle_nodes_cpu_percent_64": idle_nodes,
                    "idle_cpu_percent_64_heartbeat_0.2": idle_fast,
                    "startup_64_s": idle_ready,
                }
            )
    labels = [
        ("startup_16_s", "16 no-op workers RUNNING (s)", "<= 3 (local)"),
        ("idle_cpu_percent_16", f"idle master CPU, 16 workers, heartbeat {HEARTBEAT_S:g} s (% of a core)", "-"),
        ("sigkill_detect_s", "SIGKILL detected (s)", "<= 1"),
        ("hang_detect_s", f"hung worker detected (s, deadline {hang_timeout:g} s)", f"<= {hang_timeout + 1:g}"),
        ("lost_worker_running_s", "lost worker back to RUNNING (s)", "<= 2 (local)"),
        ("master_resume_s", "killed master resumed (s)", "<= 3 (local)"),
        ("master_resume_restarts", "  live workers restarted by the resume", "0"),
        ("master_resume_same_pids", "  same pids after resume", "True"),
        ("idle_cpu_percent_64", f"idle master CPU, 64 workers, heartbeat {HEARTBEAT_S:g} s (% of a core, {window:g} s)",
         "<= 2"),
        ("idle_nodes_cpu_percent_64", "  the 64 node processes together (% of a core)", "-"),
        ("idle_cpu_percent_64_heartbeat_0.2",
         f"idle master CPU, 64 workers, heartbeat 0.2 s (% of a core, {window:g} s)", "-"),
        ("startup_64_s", "  64 workers RUNNING (s)", "-"),
    ]  # fmt: skip
    rows = []
    for key, label, goal in labels:
        values = [results[b].get(key, "-") for b in backends]
        if all(v == "-" for v in values):
            continue
        rows.append((label, *[str(v) if isinstance(v, bool) else v for v in values], goal))
    figures: dict[str, Any] = {
        "heartbeat_interval_s": HEARTBEAT_S,
        "hang_deadline_s": hang_timeout,
        "quick": args.quick,
    }
    figures["backends"] = results
    if "local" in results:
        figures.update(results["local"])  # the local figures stay where earlier runs had them
    title = "control plane: " + " vs ".join(f"{b} backend" for b in backends)
    report("control_plane", title, ("figure", *backends, "goal"), rows, figures)


if __name__ == "__main__":
    main()
