"""Elastic training on real processes: an ElasticMaster, ElasticWorkers, and examples/elastic_train.py
(plain torch.distributed with gloo) as the user's script. Faults come from the test: SIGKILL sent
to a script or a node, or RLPLEX_TEST_FAULTS read by the test worker `CheckedElasticWorker`."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest

from node_helpers import listening_sockets, node_processes, wait_for
from rlplex.control import (
    JobBuilder,
    JobSpec,
    JobState,
    PrimeMaster,
    RendezvousState,
    SqliteStateStore,
    parse_job,
)
from rlplex.control.elastic.master import read_elastic_status, rendezvous_summaries
from rlplex.control.elastic.rdzv import (
    RDZV_TRANSITIONS,
    ElasticConfig,
    RendezvousError,
    ScriptConfig,
    dist_env,
    failed_checks,
    local_layout,
    parse_role_config,
    rendezvous_endpoint,
    slow_nodes,
)
from rlplex.control.job.master import read_token
from rlplex.control.job.states import StateMachine
from rlplex.control.node.role_group import RoleGroup
from rlplex.control.node.worker import WorkerContext
from rlplex.errors import IllegalTransitionError, JobFailedError, JobSpecError
from timing import scaled

SCRIPT = str(Path(__file__).resolve().parents[2] / "examples" / "elastic_train.py")
STEPS, CKPT_EVERY = 60, 10


def elastic_job(
    job_dir: Path, count: int = 2, step_delay: float = 0.0, entrypoint: str = "rlplex.control.elastic:ElasticWorker",
    script: dict[str, Any] | None = None, master_restart: dict[str, Any] | None = None, **master: Any,
) -> JobSpec:  # fmt: skip
    args = ["--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), "--lr", "0.03", "--step-delay", str(step_delay)]
    return (
        JobBuilder("elastic", job_dir, capacity={"cpu": 2}, heartbeat_interval_s=0.1, rpc_timeout_s=90.0)
        .role("trainer", entrypoint=entrypoint, count=count, resources={"cpu": 0.5}, heartbeat_timeout_s=scaled(10.0),
              config=script or {"script": SCRIPT, "args": args})
        .role("elastic", kind="submaster", entrypoint="rlplex.control.elastic:ElasticMaster",
              resources={"cpu": 0.1}, heartbeat_timeout_s=scaled(10.0),
              restart=master_restart or {"scope": "worker", "max_restarts": 3},
              config={"workers": "trainer", "join_timeout_s": scaled(5.0), **master})
        .build()
    )  # fmt: skip


def restart_causes(job_dir: Path) -> list[str]:
    """Why each re-rendezvous happened, for the message of a failed assertion on the restart count."""
    history = read_elastic_status(job_dir).get("history", [])
    return [h["cause"] for h in history if h["new"] in ("RESTARTING", "FAILED")]


def result(job_dir: Path) -> dict[str, Any]:
    (path,) = (job_dir / "elastic" / "checkpoints").glob("*/result.json")  # one job: one checkpoint folder
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def progress(job_dir: Path, node_id: str) -> dict[str, float]:
    try:
        data: dict[str, float] = json.loads((job_dir / "elastic" / "progress" / f"{node_id}.json").read_text())
        return data
    except (OSError, ValueError):
        return {}


def job_processes(job_dir: Path) -> list[int]:
    """Every live process of this job (nodes, scripts, checks): they carry the job's folder in their environment."""
    folder = str(job_dir.resolve())
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("RLPLEX_JOB_DIR") == folder and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process.pid)
        except psutil.Error:
            continue
    return found


def rendezvous_steps(master: PrimeMaster) -> list[str]:
    return [r.new for r in master.store.transitions(master.job_id) if r.entity == "elastic-0:rendezvous"]


def script_of(master: PrimeMaster, node_id: str) -> psutil.Process:
    node = next(n for n in master.get_nodes_by_role()["trainer"] if n.node_id == node_id)
    (script,) = [p for p in psutil.Process(node.pid).children(recursive=True) if SCRIPT in " ".join(p.cmdline())]
    return script


def test_rendezvous_state_machine_and_check_verdicts() -> None:
    machine = StateMachine(RDZV_TRANSITIONS, RendezvousState.INIT, None, "job", "elastic-0:rendezvous")
    for state in ("WAITING", "CHECKING", "READY", "RUNNING", "RESTARTING", "WAITING", "READY", "RUNNING", "FINISHED"):
        machine.transition(RendezvousState(state), "test")
    with pytest.raises(IllegalTransitionError, match="FINISHED -> RUNNING"):
        machine.transition(RendezvousState.RUNNING, "no way back")
    results = {
        "a": {"ok": True, "matmul_s": 0.010},
        "b": {"ok": True, "matmul_s": 0.011},
        "c": {"ok": True, "matmul_s": 0.050},
        "d": {"ok": False, "error": "gloo timeout"},
    }
    assert list(slow_nodes(results, 2.0)) == ["c"] and "x the median" in slow_nodes(results, 2.0)["c"]
    assert failed_checks(results) == {"d": "gloo timeout"}
    with pytest.raises(ValueError, match="min_nodes"):
        ElasticConfig(workers="t", min_nodes=3, max_nodes=2)
    with pytest.raises(ValueError, match="exactly one of 'script'"):
        ScriptConfig()


def test_the_rendezvous_store_is_where_rank_0_runs() -> None:
    """MASTER_ADDR:MASTER_PORT of a round is the endpoint rank 0's node reported: 127.0.0.1 on one machine,
    the node's own IP (asked of Ray on that node) on a multi-machine Ray cluster."""
    assert rendezvous_endpoint("trainer-3", {"endpoint": {"host": "10.0.0.7", "port": 29511}}) == ("10.0.0.7", 29511)
    bad_reports = ({}, {"endpoint": "x"}, {"endpoint": {"host": "", "port": 1}}, {"endpoint": {"host": "h", "port": 0}})
    for bad in bad_reports:
        with pytest.raises(RendezvousError, match=r"member trainer-3 \(rank 0\) reported no usable endpoint"):
            rendezvous_endpoint("trainer-3", bad)
    pytest.importorskip("ray")
    import ray

    from rlplex.control.backends.ray_node import node_host

    assert node_host("127.0.0.1") == "127.0.0.1"  # a one-machine cluster: loopback, as on the local backend
    assert node_host("192.0.2.1") == ray.util.get_node_ip_address()


def test_elastic_job_trains_to_completion_with_every_port_on_loopback(job_dir: Path) -> None:
    """The job trains to its end; while it trains, the master's listener, every node's RPC, the
    rendezvous store of the check and of the training round, and gloo's own sockets are all on
    127.0.0.1 on the local backend (the store authenticates no one)."""
    with PrimeMaster.create(elastic_job(job_dir, step_delay=0.05)) as master:
        master.start()  # prepare() runs the node check of both ranks: a gloo group of its own
        wait_for(lambda: progress(job_dir, "trainer-1").get("step", 0) >= 3, 40, "both ranks training")
        nodes = node_processes(job_dir)
        processes = [psutil.Process(), *nodes, *(c for n in nodes for c in n.children(recursive=True))]
        assert sum(SCRIPT in " ".join(p.cmdline()) for p in processes) == 2  # both scripts are being looked at
        found = listening_sockets(processes)
        store_port = read_elastic_status(job_dir)["rounds"][-1]["port"]
        assert any(port == store_port for _, _, port in found), found  # the round's store is among them
        assert len(found) >= 1 + len(nodes) + 1
        assert [f for f in found if f[1] not in ("127.0.0.1", "::1")] == []
        assert master.wait(timeout=scaled(60)) == JobState.STOPPED
        done = result(job_dir)
        assert done["steps"] == STEPS and done["world"] == 2
        assert done["restarts"] == 0, restart_causes(job_dir)
        assert done["final_loss"] < 0.1  # the target's variance is about 0.5
        assert rendezvous_steps(master) == ["WAITING", "CHECKING", "READY", "RUNNING", "FINISHED"]
        status = read_elastic_status(job_dir)
        assert status["state"] == "FINISHED" and set(status["checks"]) == {"trainer-0", "trainer-1"}
        assert [r["addr"] for r in status["rounds"]] == ["127.0.0.1"]  # rank 0's node, on the local backend
        assert all(c["ok"] and c["matmul_s"] > 0 for c in status["checks"].values())
        assert rendezvous_summaries(job_dir) == [
            "elastic-0 (role 'trainer'): rendezvous FINISHED, world 2, restarts 0, epoch 0.2"
        ]
        nodes = master.store.nodes(master.job_id)
        assert {n.state for n in nodes} == {"FINISHED"} and all(n.restarts == 0 for n in nodes)


def test_a_function_entrypoint_gets_its_config_and_request_stop_ends_it_gracefully(
    job_dir: Path, tmp_path: Path
) -> None:
    """The trainer's wiring: `{"entrypoint", "config"}` runs the function with its config model,
    and the control RPC `request_stop` is its graceful stop: exit 0, so every node FINISHED."""
    out = tmp_path / "waiter.txt"
    script = {"entrypoint": "control_workers:wait_for_stop", "config": {"out": str(out), "seconds": 120}}
    with PrimeMaster.create(elastic_job(job_dir, count=1, script=script, node_check=False)) as master:
        master.start()
        wait_for(lambda: out.exists() and out.read_text() == "ready", 60, "the entrypoint to start")
        context = WorkerContext(master.job_id, "test", 0, "test", {}, {}, job_dir, token=read_token(job_dir))
        group = RoleGroup.connect(context, "trainer")
        try:
            assert [future.result(timeout=30) for future in group.call("request_stop")] == [True]
        finally:
            group.close()
        assert master.wait(timeout=scaled(60)) == JobState.STOPPED
        assert out.read_text() == "stopped"
        assert {n.state for n in master.store.nodes(master.job_id)} == {"FINISHED"}
        assert rendezvous_steps(master) == ["WAITING", "READY", "RUNNING", "FINISHED"]


def test_local_rank_counts_the_ranks_on_the_same_machine() -> None:
    """Two machines, ranks interleaved: LOCAL_RANK picks the GPU on its own machine, not the global rank."""
    hosts = ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2", "10.0.0.1"]
    layout = local_layout(hosts)
    envs = [dist_env({"rank": i, "world": 5, "addr": "10.0.0.1", "port": 29500, **layout[i]}) for i in range(5)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3", "4"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "1", "2"]
    assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["3", "3", "2", "2", "3"]
    assert [e["GROUP_RANK"] for e in envs] == ["0", "0", "1", "1", "0"]
    assert all(e["TORCHELASTIC_USE_AGENT_STORE"] == "True" and "GLOO_SOCKET_IFNAME" not in e for e in envs)
    one_machine = local_layout(["127.0.0.1"] * 2)
    assert [(x["local_rank"], x["local_world"], x["group_rank"]) for x in one_machine] == [(0, 2, 0), (1, 2, 0)]


def test_sigkilled_script_then_node_rerendezvous_and_resume_from_checkpoints(job_dir: Path) -> None:
    with PrimeMaster.create(elastic_job(job_dir, step_delay=0.02, node_check=False)) as master:
        master.start()
        # 1. rank 1's script dies: its node stays healthy, the ElasticMaster restarts every script.
        wait_for(lambda: progress(job_dir, "trainer-1").get("step", 0) >= CKPT_EVERY + 2, 40, "rank 1 past step 12")
        killed_at = progress(job_dir, "trainer-1")["step"]
        script_of(master, "trainer-1").send_signal(signal.SIGKILL)
        wait_for(lambda: len(read_elastic_status(job_dir).get("rounds", [])) == 2, 30, "the second round")
        # 2. rank 0's node dies: the PrimeManager restarts it, the ElasticMaster takes the replacement in.
        wait_for(lambda: progress(job_dir, "trainer-0").get("step", 0) >= 2 * CKPT_EVERY + 2, 40, "rank 0 past step 22")
        victim = next(n for n in master.get_nodes_by_role()["trainer"] if n.node_id == "trainer-0")
        orphan = script_of(master, "trainer-0")
        os.kill(victim.pid, signal.SIGKILL)  # the node alone, not its process group
        # Its script dies with it by itself (nothing else has acted yet: the master is not monitoring).
        wait_for(lambda: not orphan.is_running() or orphan.status() == psutil.STATUS_ZOMBIE, 10, "the script to die")
        assert master.wait(timeout=scaled(60)) == JobState.STOPPED
        done = result(job_dir)
        assert done["steps"] == STEPS and done["restarts"] == 2, restart_causes(job_dir)
        assert done["world"] == 2
        assert done["resumed_from"] >= 2 * CKPT_EVERY and done["resumed_from"] % CKPT_EVERY == 0
        assert done["final_loss"] < 0.1  # the target's variance is about 0.5
        status = read_elastic_status(job_dir)
        first, second, _third = status["rounds"]
        assert first["resumed_from"] == 0 and CKPT_EVERY <= second["resumed_from"] <= killed_at
        assert rendezvous_steps(master) == ["WAITING", "READY", "RUNNING"] + ["RESTARTING", "WAITING", "READY",
                                            "RUNNING"] * 2 + ["FINISHED"]  # fmt: skip
        causes = [r.cause for r in master.store.transitions(master.job_id) if r.new == "RESTARTING"]
        assert "rank 1 (trainer-1): script exited with code -9" in causes[0]
        assert "member trainer-0 (rank 0) lost" in causes[1]
        nodes = {n.node_id: n for n in master.store.nodes(master.job_id)}
        assert nodes["trainer-1"].restarts == 0  # the script's death cost no node restart
        assert nodes["trainer-0"].restarts == 1 and nodes["trainer-0"].pid != victim.pid
        assert status["members"]["trainer-0"]["incarnation"] == 1
        assert job_processes(job_dir) == []  # no script or check outlived its node


def test_a_lost_rank_aborts_a_survivor_blocked_in_a_store_wait_instead_of_waiting_out_its_stop(job_dir: Path) -> None:
    """Rank 0 fails while rank 1 waits on the round's store (served by rank 0's live node), where
    it hears no SIGTERM: the survivor is killed after `abort_grace_s`, not granted its 300 s graceful
    `stop_grace_s`, and the next round starts before the master's `stop_timeout_s` (60 s) runs out."""
    survivor = str(Path(__file__).with_name("blocked_survivor.py"))
    script = {"script": survivor, "stop_grace_s": 300.0, "abort_grace_s": 0.5}
    spec = elastic_job(job_dir, script=script, node_check=False, stop_timeout_s=60.0, max_restarts=1)
    with PrimeMaster.create(spec) as master:
        master.start()
        assert master.wait(timeout=scaled(40)) == JobState.STOPPED, restart_causes(job_dir)
        causes = restart_causes(job_dir)
        assert len(causes) == 1 and "rank 0 (trainer-0): script exited with code 1" in causes[0], causes
        assert [r["restarts"] for r in read_elastic_status(job_dir)["rounds"]] == [0, 1]
        assert job_processes(job_dir) == []


def test_killed_elastic_master_takes_over_then_a_scaled_down_role_trains_on_with_the_survivor(job_dir: Path) -> None:
    with PrimeMaster.create(elastic_job(job_dir, step_delay=0.02, node_check=False, min_nodes=1)) as master:
        master.start()
        # 1. The ElasticMaster dies: the PrimeManager restarts it; the new one stops the scripts and takes over.
        wait_for(lambda: progress(job_dir, "trainer-0").get("step", 0) >= CKPT_EVERY + 2, 40, "rank 0 past step 12")
        (old,) = master.get_nodes_by_role()["elastic"]
        os.kill(old.pid, signal.SIGKILL)
        wait_for(lambda: master.monitor() and len(read_elastic_status(job_dir).get("rounds", [])) == 2, 30, "round 2")
        # 2. trainer-1 goes for good (scale down); min_nodes = 1 lets rank 0 train on alone.
        wait_for(lambda: progress(job_dir, "trainer-1").get("step", 0) >= 2 * CKPT_EVERY + 2, 40, "rank 1 past 22")
        master.scale_role("trainer", 1)
        assert master.wait(timeout=scaled(60)) == JobState.STOPPED
        done = result(job_dir)
        assert done["steps"] == STEPS and done["restarts"] == 2, restart_causes(job_dir)
        assert done["world"] == 1
        assert done["resumed_from"] >= 2 * CKPT_EVERY and done["final_loss"] < 0.1
        status = read_elastic_status(job_dir)
        assert [r["world"] for r in status["rounds"]] == [2, 2, 1]
        nodes = {n.node_id: n for n in master.store.nodes(master.job_id)}
        assert nodes["elastic-0"].restarts == 1 and nodes["trainer-0"].restarts == 0
        assert nodes["trainer-1"].state == "STOPPED"
        steps = rendezvous_steps(master)
        assert steps == ["WAITING", "READY", "RUNNING"] * 2 + ["RESTARTING", "WAITING", "READY", "RUNNING", "FINISHED"]
        causes = [r.cause for r in master.store.transitions(master.job_id) if r.entity == "elastic-0:rendezvous"]
        assert causes[3] == "taking over after restart #1" and "trainer-1 (rank 1) lost: node is STOPPED" in causes[6]


def test_a_scaled_up_role_grows_the_world_and_the_joiner_is_checked_first(job_dir: Path) -> None:
    # Slow enough steps that the joiner (a node process importing torch, then its node check)
    # arrives while rank 0 still trains: with 0.02 s a busy machine saw every step done first.
    spec = elastic_job(job_dir, count=1, step_delay=scaled(0.1), min_nodes=1, max_nodes=2)
    with PrimeMaster.create(spec) as master:
        master.start()
        wait_for(lambda: progress(job_dir, "trainer-0").get("step", 0) >= CKPT_EVERY + 2, 40, "rank 0 past step 12")
        master.scale_role("trainer", 2)
        assert master.wait(timeout=scaled(60)) == JobState.STOPPED
        done = result(job_dir)
        assert done["steps"] == STEPS and done["world"] == 2
        assert done["restarts"] == 1, restart_causes(job_dir)
        assert done["resumed_from"] >= CKPT_EVERY and done["final_loss"] < 0.1
        status = read_elastic_status(job_dir)
        assert [r["world"] for r in status["rounds"]] == [1, 2]
        assert status["rounds"][1]["ranks"] == {"trainer-0": 0, "trainer-1": 1}  # the survivor keeps rank 0
        assert "['trainer-1'] joined; growing the world" in restart_causes(job_dir)[0]
        assert set(status["checks"]) == {"trainer-0", "trainer-1"}  # the joiner passed its own node check
        steps = rendezvous_steps(master)
        assert steps == ["WAITING", "CHECKING", "READY", "RUNNING", "RESTARTING", "WAITING", "CHECKING", "READY",
                         "RUNNING", "FINISHED"]  # fmt: skip
        nodes = master.store.nodes(master.job_id)
        assert {n.state for n in nodes} == {"FINISHED"} and all(n.restarts == 0 for n in nodes)


def test_a_script_failing_every_time_spends_the_budget_and_fails_the_job(job_dir: Path) -> None:
    failing = {"module": "json.tool", "args": [str(job_dir / "no-such-input.json")]}
    spec = elastic_job(job_dir, script=failing, node_check=False, max_restarts=1, master_restart={"scope": "never"})
    with PrimeMaster.create(spec) as master:
        master.start()
        with pytest.raises(JobFailedError, match=r"restart budget spent \(1\); last cause: rank \d \(trainer-\d\): "
                           r"script exited with code 2"):  # fmt: skip
            master.wait(timeout=scaled(60))
        assert node_processes(job_dir) == [] and job_processes(job_dir) == []
        assert rendezvous_steps(master)[-3:] == ["RUNNING", "RESTARTING", "FAILED"]
        assert "restart budget spent" in read_elastic_status(job_dir)["error"]


def test_failing_node_check_fails_prepare_with_the_reason(job_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPLEX_TEST_FAULTS", "node_check@trainer-1")
    master = PrimeMaster.create(elastic_job(job_dir, entrypoint="control_workers:CheckedElasticWorker"))
    try:
        with pytest.raises(JobFailedError, match="node check failed: trainer-1: injected node check failure"):
            master.start()
        assert node_processes(job_dir) == [] and job_processes(job_dir) == []
        store = SqliteStateStore.in_dir(job_dir, create=False)
        job = store.job(master.job_id)
        assert job.state == "FAILED" and "elastic-0" in job.cause
        assert rendezvous_steps(master)[-1] == "FAILED"
        assert read_elastic_status(job_dir)["state"] == "FAILED"
        store.close()
    finally:
        master.close()


def test_a_hung_node_check_fails_prepare_within_the_rpc_timeout(job_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPLEX_TEST_FAULTS", "hang_check@trainer-0")
    spec = elastic_job(job_dir, entrypoint="control_workers:CheckedElasticWorker")
    # Long enough for both nodes to start and import torch (their agents join only then) on a
    # busy machine, so that the hang is the check's: 3 s was seen to end the rendezvous in WAITING.
    timeout = scaled(6.0)
    spec = parse_job(spec.model_dump(mode="json") | {"rpc_timeout_s": timeout})
    master = PrimeMaster.create(spec)
    try:
        expected = rf"initial rendezvous was still CHECKING .* rpc_timeout_s \({timeout:g} s\)"
        with pytest.raises(JobFailedError, match=expected):
            master.start()
        assert node_processes(job_dir) == [] and job_processes(job_dir) == []
    finally:
        master.close()


def test_nccl_node_check_needs_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from rlplex.control.elastic.check import run_check

    monkeypatch.setenv("WORLD_SIZE", "1")
    outcome = run_check(8, 1.0, backend="nccl")
    assert outcome == {"ok": False, "error": "backend nccl needs CUDA, and torch.cuda.is_available() is False here"}


def test_elastic_role_configs_are_validated_naming_role_and_field() -> None:
    with pytest.raises(JobSpecError, match=r"(?s)role 'trainer': field 'config'.*exactly one of 'script'"):
        parse_role_config(ScriptConfig, {"script": SCRIPT, "module": "x"}, "trainer")
    with pytest.raises(JobSpecError, match=r"(?s)role 'elastic': field 'config'.*field 'workers'"):
        parse_role_config(ElasticConfig, {"workers": ""}, "elastic")
