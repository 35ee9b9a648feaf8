"""The Ray backend on a real local Ray (num_cpus=2): node actors, faults, the master as an actor.

Faults are injected as in the local tests: signals sent by the test to an actor's process, or
RLPLEX_TEST_FAULTS read by the test workers (RLPLEX_* variables reach the node actors).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from node_helpers import node_processes, wait_for
from rlplex.control import JobBuilder, JobSpec, JobState, PrimeMaster, SqliteStateStore
from rlplex.errors import ConfigError, JobFailedError, JobSpecError
from timing import scaled

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"

ray = pytest.importorskip("ray")

from rlplex.control.backends.ray import NAMESPACE  # noqa: E402
from rlplex.control.backends.ray_master import RayMasterHandle, master_actor_name  # noqa: E402

pytestmark = pytest.mark.e2e

JOB = """
name = "both"
output_dir = "{out}"
heartbeat_interval_s = 0.1
capacity = {{ cpu = 2 }}
[roles.counter]
count = 2
entrypoint = "control_workers:Counter"
resources = {{ cpu = 0.5 }}
config = {{ items = 40, delay_s = 0.01 }}
"""


def leftovers() -> list[str]:
    actors = [str(e["name"]) for e in ray.util.list_named_actors(all_namespaces=True) if e["namespace"] == NAMESPACE]
    groups = [str(i["name"]) for i in ray.util.placement_group_table().values() if i["state"] != "REMOVED"]
    return actors + groups


@pytest.fixture(autouse=True)
def nothing_left_on_ray(ray_address: str) -> Iterator[None]:
    """After each test no actor or placement group of ours may be left (killed first, then the test fails)."""
    yield
    try:
        wait_for(lambda: not leftovers(), 10, "no rlplex actors or placement groups left")
    finally:
        left = leftovers()
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["namespace"] == NAMESPACE:
                ray.kill(ray.get_actor(entry["name"], namespace=NAMESPACE))
        assert not left, f"left on Ray: {left}"


def counter_job(job_dir: Path, items: int = 40, delay_s: float = 0.02, count: int = 2, **role: Any) -> JobSpec:
    # Every Ray actor is a fresh Python process (about a second each here): the jobs stay small.
    return (
        JobBuilder("rayfaults", job_dir, backend="ray", capacity={"cpu": 2}, heartbeat_interval_s=0.1)
        .role("counter", entrypoint="control_workers:Counter", count=count, resources={"cpu": 0.5},
              config={"items": items, "delay_s": delay_s}, **role)
        .build()
    )  # fmt: skip


def items_done(job_dir: Path) -> list[int]:
    return sorted(int(x) for f in (job_dir / "items").glob("*.txt") for x in f.read_text().split())


def decisions(store: SqliteStateStore, job_id: str) -> list[tuple[str, str, str]]:
    return [(d.old, d.entity, d.cause) for d in store.decisions(job_id)]


def progress_of(master: PrimeMaster, node_id: str) -> float:
    master.monitor()
    node = next(n for n in master.get_nodes_by_role()["counter"] if n.node_id == node_id)
    return float(node.progress.get("items", 0))


def test_the_same_job_file_runs_on_both_backends(tmp_path: Path, ray_address: str, child_env: dict[str, str]) -> None:
    out = tmp_path / "job"
    job_file = tmp_path / "job.toml"
    job_file.write_text(JOB.format(out=out))
    with PrimeMaster.create(job_file, backend="local") as master:
        master.start()
        assert master.wait(timeout=scaled(30)) == JobState.STOPPED
    assert items_done(out) == list(range(40)) and node_processes(out) == []
    shutil.move(out, tmp_path / "local")

    # The CLI runs the master as an actor on the test's cluster (--ray-address beats RLPLEX_BACKEND).
    env = {**child_env, "RLPLEX_BACKEND": "local", "COLUMNS": "200"}
    command = [sys.executable, "-m", "rlplex.cli", "job", "run", str(job_file), "--backend", "ray",
               "--ray-address", ray_address]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "master actor started on Ray" in result.stdout and ": FINISHED" in result.stdout
    assert items_done(out) == list(range(40))
    store = SqliteStateStore.in_dir(out, create=False)
    job_id = store.latest_job_id()
    assert job_id is not None and store.job(job_id).state == "STOPPED"
    assert '"backend":"ray"' in store.job(job_id).spec_json
    assert [(n.node_id, n.state, n.restarts) for n in store.nodes(job_id)] == [
        ("counter-0", "FINISHED", 0), ("counter-1", "FINISHED", 0)
    ]  # fmt: skip
    assert all(n.pid > 0 and n.pid != os.getpid() for n in store.nodes(job_id))
    store.close()


def test_user_code_sees_the_job_token_only_when_its_role_asks(
    tmp_path: Path, ray_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A master that itself runs with a token in its environment must not hand it on either.
    monkeypatch.setenv("RLPLEX_JOB_TOKEN", "00" * 32)
    for backend in ("local", "ray"):
        out = tmp_path / backend
        spec = (
            JobBuilder("token", out, backend=backend, capacity={"cpu": 2}, heartbeat_interval_s=0.1)
            .role("plain", entrypoint="control_workers:token_probe", resources={"cpu": 0.5})
            .role("trusted", entrypoint="control_workers:token_probe", resources={"cpu": 0.5}, needs_job_token=True)
            .build()
        )
        with PrimeMaster.create(spec) as master:
            master.start()
            assert master.wait(timeout=scaled(60)) == JobState.STOPPED, backend
        plain = json.loads((out / "token" / "plain-0.json").read_text())
        trusted = json.loads((out / "token" / "trusted-0.json").read_text())
        assert plain == {"environ": None, "child": False, "launch": False, "matches": False}, backend
        assert trusted["matches"] and trusted["child"] and not trusted["launch"], backend
        assert node_processes(out) == []


def test_a_role_asking_for_the_token_is_validated(job_dir: Path) -> None:
    with pytest.raises(JobSpecError, match="needs_job_token"):
        counter_job(job_dir, needs_job_token="sometimes")


def test_sigkilled_node_actor_is_restarted_and_the_job_finishes(job_dir: Path) -> None:
    with PrimeMaster.create(counter_job(job_dir, items=40, delay_s=0.05)) as master:
        master.start()
        wait_for(lambda: progress_of(master, "counter-1") >= 3, 20, "counter-1 to process 3 items")
        victim = master.get_nodes_by_role()["counter"][1].pid
        assert victim not in (0, os.getpid())
        os.kill(victim, signal.SIGKILL)
        assert master.wait(timeout=scaled(40)) == JobState.STOPPED
        assert items_done(job_dir) == list(range(40))
        nodes = {n.node_id: n for n in master.store.nodes(master.job_id)}
        assert nodes["counter-1"].restarts == 1 and nodes["counter-1"].pid not in (0, victim)
        assert nodes["counter-0"].restarts == 0
        ((action, target, cause),) = decisions(master.store, master.job_id)
        assert (action, target) == ("RESTART_WORKER", "counter-1")
        assert "node counter-1 (role 'counter') failed: process exited" in cause


def test_a_hung_worker_is_detected_and_replaced(job_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPLEX_TEST_FAULTS", "stall@counter-0")
    with PrimeMaster.create(counter_job(job_dir, items=10, count=1, progress_timeout_s=1.0)) as master:
        master.start()
        assert master.wait(timeout=scaled(40)) == JobState.STOPPED
        assert items_done(job_dir) == list(range(10))
        ((action, target, cause),) = decisions(master.store, master.job_id)
        assert (action, target) == ("RESTART_WORKER", "counter-0") and "no progress for" in cause


def test_exhausted_restart_budget_fails_the_job_and_leaves_no_actor(
    job_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLPLEX_TEST_FAULTS", "crash@counter-0")
    with PrimeMaster.create(counter_job(job_dir, count=1, restart={"max_restarts": 1})) as master:
        master.start()
        with pytest.raises(JobFailedError, match=r"role 'counter' exhausted its restart budget \(1\)"):
            master.wait(timeout=scaled(40))
        assert master.state == JobState.FAILED and leftovers() == []
        job = master.store.job(master.job_id)
        assert "injected crash" in job.cause and "restart budget" in job.cause
        assert [d[0] for d in decisions(master.store, master.job_id)] == ["RESTART_WORKER", "FAIL_JOB"]


def test_failing_self_check_fails_prepare_and_leaves_nothing(job_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPLEX_TEST_FAULTS", "self_check@counter-1")
    master = PrimeMaster.create(counter_job(job_dir, count=2))
    try:
        with pytest.raises(JobFailedError, match="injected self_check failure: disk not writable"):
            master.start()
        assert leftovers() == []
        job = master.store.job(master.job_id)
        assert job.state == "FAILED" and "counter-1" in job.cause
        assert all(n.state == "STOPPED" for n in master.store.nodes(master.job_id))
    finally:
        master.close()


def test_a_role_scales_up_and_down_on_ray(job_dir: Path) -> None:
    """Scaling down gives the bundle back to Ray (a second scale-up fits in the same cluster)."""
    spec = (
        JobBuilder("rayscale", job_dir, backend="ray", capacity={"cpu": 2})
        .role("idle", entrypoint="control_workers:Idle", count=1, resources={"cpu": 0.75})
        .build()
    )
    with PrimeMaster.create(spec) as master:
        master.start()

        def running() -> list[str]:
            master.monitor()
            return [n.node_id for n in master.get_nodes_by_role()["idle"] if n.state == "RUNNING"]

        for count in (2, 1, 2):
            master.scale_role("idle", count)
            wait_for(lambda: len(running()) == count, 30, f"{count} idle nodes RUNNING")  # noqa: B023
        names = {str(e["name"]) for e in ray.util.list_named_actors(all_namespaces=True)}
        assert {f"rlplex-{master.job_id}-idle-{i}" for i in range(2)} <= names
        master.stop()
        assert master.state == JobState.STOPPED


def test_killed_master_actor_resumes_and_restarts_only_the_lost_node(job_dir: Path) -> None:
    """The master actor and a node die together: Ray restarts the master, which re-attaches to the live
    nodes (not restarted) and restarts the lost one into its own bundle."""
    handle = RayMasterHandle.launch(counter_job(job_dir, items=90, delay_s=0.04, count=3))
    try:
        store = SqliteStateStore.in_dir(job_dir)

        def progressed() -> bool:
            job_id = store.latest_job_id()
            nodes = store.nodes(job_id) if job_id else []
            return len(nodes) == 3 and all(n.state == "RUNNING" and n.progress.get("items", 0) >= 3 for n in nodes)

        wait_for(progressed, 30, "every node RUNNING with progress")
        job_id = store.latest_job_id()
        assert job_id is not None
        before = {n.node_id: n.pid for n in store.nodes(job_id)}
        first = handle.info()
        assert not first["resumed"]
        os.kill(int(first["pid"]), signal.SIGKILL)
        os.kill(before["counter-0"], signal.SIGKILL)

        def restarted() -> bool:
            return any(n.node_id == "counter-0" and n.restarts == 1 and n.pid for n in store.nodes(job_id))

        wait_for(restarted, 30, "counter-0 restarted by the resumed master")
        # It went back into the bundle the first master made for it: no new placement group.
        groups = [str(i["name"]) for i in ray.util.placement_group_table().values()
                  if str(i["name"]).startswith(f"rlplex-{job_id}-pg-") and i["state"] == "CREATED"]  # fmt: skip
        assert sorted(g.rsplit("-", 1)[0] for g in groups) == [f"rlplex-{job_id}-pg-counter-{i}" for i in range(3)]

        assert handle.wait(timeout=scaled(60)) == JobState.STOPPED
        final = handle.info()
        assert final["resumed"] and final["pid"] != first["pid"] and final["job_id"] == job_id
        nodes = {n.node_id: n for n in store.nodes(job_id)}
        assert nodes["counter-0"].restarts == 1 and nodes["counter-0"].pid not in (0, before["counter-0"])
        assert {k: (n.pid, n.restarts) for k, n in nodes.items() if k != "counter-0"} == {
            k: (pid, 0) for k, pid in before.items() if k != "counter-0"
        }
        assert all(n.state == "FINISHED" for n in nodes.values()) and items_done(job_dir) == list(range(90))
        failover, (action, target, cause) = decisions(store, job_id)
        assert failover[:2] == ("FAILOVER", "master"), failover  # the new master actor took over
        assert (action, target) == ("RESTART_WORKER", "counter-0") and "process exited" in cause
        assert [r.new for r in store.transitions(job_id) if r.entity == "job"] == [
            "READY", "RUNNING", "READY", "RUNNING", "STOPPING", "STOPPED"
        ]  # fmt: skip
        log = (job_dir / "master.log").read_text()
        assert "re-attached" in log
        store.close()
    finally:
        handle.close()


def test_cli_resume_of_a_ray_job_runs_the_new_master_as_an_actor(
    job_dir: Path, ray_address: str, child_env: dict[str, str]
) -> None:
    """The master actor is gone for good (no Ray restart left): `rlplex job resume` starts a new master
    actor, not a master in the CLI process, which re-attaches to the live node actors and finishes the job.
    A second master for a folder whose master lives is refused."""
    handle = RayMasterHandle.launch(counter_job(job_dir, items=200, delay_s=0.1), max_restarts=0)
    store = SqliteStateStore.in_dir(job_dir)
    cli: subprocess.Popen[str] | None = None
    try:

        def progressed() -> bool:
            job_id = store.latest_job_id()
            nodes = store.nodes(job_id) if job_id else []
            return len(nodes) == 2 and all(n.state == "RUNNING" and n.progress.get("items", 0) >= 3 for n in nodes)

        wait_for(progressed, 30, "every node RUNNING with progress")
        job_id = store.latest_job_id()
        assert job_id is not None
        before = {n.node_id: n.pid for n in store.nodes(job_id)}
        first_pid = int(handle.info()["pid"])
        assert store.job(job_id).master_pid == first_pid
        with pytest.raises(ConfigError, match="already has a live master"):
            RayMasterHandle.launch(handle.spec)

        ray.kill(handle.actor, no_restart=True)
        named = master_actor_name(handle.spec)
        wait_for(lambda: named not in {e["name"] for e in ray.util.list_named_actors(True)}, 20, "the master gone")
        command = [sys.executable, "-m", "rlplex.cli", "job", "resume", str(job_dir), "--ray-address", ray_address]
        cli = subprocess.Popen(command, env={**child_env, "COLUMNS": "200"}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
        out, _ = cli.communicate(timeout=120)
        assert cli.returncode == 0, out
        assert "master actor resumed on Ray" in out and ": FINISHED" in out

        job = store.job(job_id)
        assert job.state == "STOPPED" and job.master_pid not in (0, first_pid, cli.pid)
        nodes = {n.node_id: n for n in store.nodes(job_id)}
        assert {k: (n.pid, n.restarts, n.state) for k, n in nodes.items()} == {
            k: (pid, 0, "FINISHED") for k, pid in before.items()
        }
        assert items_done(job_dir) == list(range(200)) and [d[:2] for d in decisions(store, job_id)] == [
            ("FAILOVER", "master")
        ]
        assert "re-attached" in (job_dir / "master.log").read_text()
    finally:
        if cli is not None and cli.poll() is None:
            cli.kill()
            cli.wait(10)
        handle.close()
        store.close()


def test_a_self_loop_job_on_ray_passes_items_through_ray_channels_and_removes_them(job_dir: Path) -> None:
    """Seed 003's self-loop on the Ray backend: the stages' channels are RayDataChannels (detached
    actors the job's end destroys: the fixture finds no actor of ours left)."""
    spec = (
        JobBuilder("rayloop", job_dir, backend="ray", capacity={"cpu": 2}, heartbeat_interval_s=0.1)
        .role("produce", entrypoint="rlplex.control:SelfLoopWorker", resources={"cpu": 0.3},
              config={"stage": "control_workers:numbers", "sink": "n", "capacity": 4, "settings": {"items": 30}})
        .role("double", entrypoint="rlplex.control:SelfLoopWorker", resources={"cpu": 0.3},
              config={"stage": "control_workers:doubled", "source": "n", "sink": "d", "capacity": 4})
        .role("collect", entrypoint="rlplex.control:SelfLoopWorker", resources={"cpu": 0.3},
              config={"stage": "control_workers:collected", "source": "d", "capacity": 4})
        .build()
    )  # fmt: skip

    def channels() -> list[str]:
        return [
            e["name"] for e in ray.util.list_named_actors(all_namespaces=True) if e["name"].startswith("rlplex-ch-")
        ]

    with PrimeMaster.create(spec) as master:
        master.start()
        assert wait_for(lambda: len(channels()) == 2, 60, "the job's two channel actors")
        assert master.wait(timeout=scaled(120)) == JobState.STOPPED, master.cause
        assert master.cause == "every node finished"
    assert [int(line) for line in (job_dir / "collected.txt").read_text().split()] == [2 * i for i in range(30)]
    assert channels() == []


def test_without_an_address_the_job_starts_a_ray_of_its_own_beside_one_from_ray_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 32, hole 3: after `ray start`, `rlplex job run ... --backend ray` (no --ray-address)
    died in a 109-line traceback: Ray's default address joins that cluster, which refuses the job's
    num_cpus. Without an address rlplex now asks Ray for a new local instance; with one it joins.
    (A real local start with this address runs in every Ray test of the suite that starts a job's own Ray.)"""
    import ray

    from rlplex.control.backends import ray as ray_backend
    from rlplex.control.job.spec import Resources

    asked: list[tuple[str, dict[str, object]]] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda address, **options: asked.append((address, options)))
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}])
    assert ray_backend.connect_ray(None, Resources(cpu=2)) is True
    assert ray_backend.connect_ray("auto", Resources(cpu=2)) is False
    (own, own_options), (joined, joined_options) = asked
    assert (own, own_options["num_cpus"]) == ("local", 2)
    assert joined == "auto" and "num_cpus" not in joined_options
