"""`ElasticWorker`: a node that runs the user's training script under torchrun's environment.

From its construction on, an agent thread syncs with the role's `ElasticMaster` (found in the
job store: the sub-master role whose `config.workers` names this role): it sends a report
(script and check state, the script's progress) and reconciles towards the assignment it gets
back: run the node check, start the script for an epoch, stop it, or finish.

The script gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE (LOCAL_*: among the ranks on its
machine), MASTER_ADDR and MASTER_PORT (where rank 0 runs: its node's address, 127.0.0.1 on one
machine or that machine's IP on a multi-machine Ray cluster, and a port on which rank 0's node
serves the round's store; the script joins it as a client, TORCHELASTIC_USE_AGENT_STORE=True,
as under torchrun), RLPLEX_RESTART_COUNT
(= TORCHELASTIC_RESTART_COUNT), RLPLEX_CHECKPOINT_DIR and RLPLEX_PROGRESS_FILE, where it may
write a JSON object of numbers (e.g. {"step": 12, "loss": 0.3}); the worker reads it into its
heartbeats and reports.

Scripts and checks are forked from the node's own fork server (`rlplex.control.forker`), which
imports torch, torch.distributed and the entrypoint's module once: a restart in a new round costs
a fork, not seconds of imports. They stay in the node's process group, so killing the node's
group kills them; and they must not outlive their node however it dies (SIGKILL of the node
alone, a killed Ray actor): on Linux the server asks for SIGKILL at the death of the agent
thread that started it (an orphan guard execs it), and each child at the server's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from rlplex.control.elastic.entry import STOP_ENV
from rlplex.control.elastic.rdzv import CHECK, FINISH, RUN, PortReservation, ScriptConfig, dist_env, parse_role_config
from rlplex.control.forker import ChildProcess, ForkedProcess, ForkRequest, ForkServer
from rlplex.control.job.states import NodeState
from rlplex.control.job.store import JobStore
from rlplex.control.node.worker import Worker, WorkerContext
from rlplex.control.rpc import RpcClient, parse_address
from rlplex.errors import JobSpecError, RlplexError

# The server's orphan guard: a tiny launcher asks for SIGKILL at its parent's death, then execs the
# server (the request survives exec). The parent is the agent thread, which lives as long as the
# node does.
_ORPHAN_GUARD = (
    "import os, signal, sys\n"
    "from rlplex.processes import die_with_parent\n"
    "die_with_parent(signal.SIGKILL, int(sys.argv[1]))  # exits 137 if the node is already gone\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)
# What every script or check of a node imports (the entrypoint's module joins them).
SCRIPT_PRELOAD = ["torch", "torch.distributed", "rlplex.control.elastic.entry", "rlplex.control.elastic.check"]


def fork_server_command() -> list[str]:
    """`python -m rlplex.control.forker`, killed with its parent on Linux."""
    args = ["-m", "rlplex.control.forker"]
    if sys.platform != "linux":
        return [sys.executable, *args]
    return [sys.executable, "-c", _ORPHAN_GUARD, str(os.getpid()), *args]


def elastic_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "elastic"


def read_progress(path: Path) -> dict[str, float]:
    """The numbers of the script's progress file; {} while it is missing or half written."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def kill_tree(process: ChildProcess, grace_s: float) -> int | None:
    """SIGTERM the process and its children, SIGKILL what is left after `grace_s`; returns its exit code."""
    import psutil

    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        children = []
    for proc in [process, *children]:
        try:
            proc.terminate()
        except (psutil.Error, ProcessLookupError):
            pass
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5.0)
    _gone, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
    return process.returncode


class ElasticWorker(Worker):
    config_model = ScriptConfig

    @classmethod
    def validate_config(cls, config: dict[str, Any]) -> ScriptConfig:
        """The script's config, and an entrypoint's own config against the model it takes (the
        entrypoint's module is imported for this: the job file's check runs it before any node starts)."""
        from pydantic import ValidationError

        from rlplex.control.elastic.entry import load_function
        from rlplex.control.job.spec import nested_error

        script: ScriptConfig = cls.config_model.model_validate(config)
        if script.entrypoint is not None:
            _function, model = load_function(script.entrypoint)
            try:
                model.model_validate(script.config)
            except ValidationError as error:
                raise nested_error(error, "config") from None
        return script

    def __init__(self, context: WorkerContext) -> None:
        super().__init__(context)
        self.config: ScriptConfig = parse_role_config(ScriptConfig, context.config, context.role)
        self.dir = elastic_dir(context.output_dir)
        (self.dir / "progress").mkdir(parents=True, exist_ok=True)
        # Per job by default: a new job in the same folder trains anew; `rlplex job resume` keeps the job id.
        default_dir = self.dir / "checkpoints" / context.job_id
        self.checkpoint_dir = Path(self.config.checkpoint_dir or default_dir).resolve()
        self.progress_file = self.dir / "progress" / f"{context.node_id}.json"
        self.master_role = self._find_master_role()
        self._lock = threading.Lock()
        self._forker: ForkServer | None = None
        self._script: ForkedProcess | None = None
        self._signalled: ForkedProcess | None = None  # the script `request_stop` has signalled
        self._script_epoch = ""
        self._script_exit: int | None = None
        self._check: ForkedProcess | None = None
        self.check_file = self.dir / "checks" / f"{context.node_id}.json"
        self._check_epoch = ""
        self._check_result: dict[str, Any] | None = None
        self._finished = False
        self._stop_asked = False
        self._client: RpcClient | None = None
        # The port this node offers for a round's rendezvous store, and the one its current check
        # or script was handed (held until the next round, as the script binds it only after its imports).
        self._offered: PortReservation | None = None
        self._handed: PortReservation | None = None
        self._synced_at = self._complained_at = time.monotonic()
        self._stopped = threading.Event()  # `stop` has stopped the script: the agent thread may end
        self._agent = threading.Thread(target=self._agent_main, name=f"{context.node_id}-elastic", daemon=True)
        self._agent.start()

    def _find_master_role(self) -> str:
        with JobStore.open_readonly(self.context.output_dir, self.context.job_id) as job:
            spec = job.spec()
        for name, role in spec["roles"].items():
            if role["kind"] == "submaster" and role.get("config", {}).get("workers") == self.context.role:
                return str(name)
        raise JobSpecError(
            f"role '{self.context.role}': no sub-master role has config.workers = '{self.context.role}' "
            "(an ElasticWorker role needs an ElasticMaster)"
        )

    # ---- hooks -------------------------------------------------------------------------------
    def status(self) -> str:
        if self.error is not None:
            return NodeState.FAILED
        return NodeState.FINISHED if self._finished else self._state

    def self_check(self) -> None:
        if self.config.script is not None and not Path(self.config.script).is_file():
            raise JobSpecError(
                f"role '{self.context.role}': field 'config.script': no such file '{self.config.script}' "
                f"(relative to {Path.cwd()})"
            )
        if self.config.entrypoint is not None:
            from rlplex.control.node.worker import import_target

            try:
                import_target(self.config.entrypoint)
            except JobSpecError as error:
                raise JobSpecError(f"role '{self.context.role}': field 'config.entrypoint': {error}") from None
        if self.config.module is not None:
            import importlib.util

            try:
                found = importlib.util.find_spec(self.config.module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                raise JobSpecError(
                    f"role '{self.context.role}': field 'config.module': cannot find module '{self.config.module}'"
                )

    def request_stop(self) -> bool:
        """The script's graceful stop (a control RPC): SIGTERM to the running script, which ends its
        work cleanly and exits 0 (a trainer checkpoints every run ahead of its last checkpoint
        first); a script started after this is told by its environment. True if one was running."""
        with self._lock:
            self._stop_asked = True
            script = self._script
            if script is None or script.poll() is not None:
                return False
            # One SIGTERM per script: it has heard the first; repeats only race its exit.
            if self._signalled is not script:
                script.send_signal(signal.SIGTERM)
                self._signalled = script
            return True

    def stop(self) -> None:
        super().stop()
        with self._lock:
            self._stop_script()
            self._stop_check()
            self._release_ports()
            if self._forker is not None:
                self._forker.close()
        self._stopped.set()

    # ---- the agent ---------------------------------------------------------------------------
    def _agent_main(self) -> None:
        try:
            # Any round may make this node rank 0, whose agent serves the round's store with torch
            # (`PortReservation.serve_store`). Imported here, before the first sync: in the middle of
            # a round the import (half a minute on a busy machine) would silence this node's syncs
            # until its ElasticMaster counted it lost. A member that is still importing has simply
            # not joined yet, which the rendezvous waits for (join_timeout_s).
            # The fork server of its scripts imports torch and the entrypoint's module meanwhile, for
            # the same reason: the first script of a round must start at once.
            with self._lock:
                forker = self._fork_server()
            import torch.distributed  # noqa: F401

            forker.wait_ready(timeout_s=300.0)
            while not self.context.should_stop():
                report = self._report()
                assignment = self._sync(report)
                if assignment is not None and not self.context.should_stop():
                    with self._lock:
                        self._reconcile(assignment)
                self.context.stop_event.wait(self.config.sync_interval_s)
            # The fork server, and through it the script, die with this thread (PDEATHSIG): it
            # lives on until `stop` has given the script its graceful stop (a trainer checkpoints).
            self._stopped.wait(timeout=self.config.stop_grace_s + 10.0)
        except BaseException as error:
            traceback.print_exc()
            self.error = f"elastic agent failed: {type(error).__name__}: {error}"

    def _report(self) -> dict[str, Any]:
        with self._lock:
            script = self._script
            if script is not None and script.poll() is not None:
                self._script_exit, self._script = script.returncode, None
                print(f"{self.context.node_id}: script of epoch {self._script_epoch} exited "
                      f"with code {self._script_exit}", flush=True)  # fmt: skip
            check = self._check
            if check is not None and check.poll() is not None:
                self._check_result, self._check = self._check_outcome(check), None
            progress = read_progress(self.progress_file) if self._script_epoch else {}
            if progress:
                self.context.report_progress(**progress)
            return {
                "node_id": self.context.node_id,
                "rank": self.context.rank,
                "incarnation": self.context.incarnation,
                "script": {"epoch": self._script_epoch, "running": self._script is not None, "exit": self._script_exit},
                "check": {"epoch": self._check_epoch, "result": self._check_result},
                "progress": progress,
                "finished": self._finished,
                # Where a round's rank 0 serves the rendezvous store if this node gets rank 0.
                "endpoint": {"host": self.context.host, "port": self._offered_port()},
            }

    def _offered_port(self) -> int:
        if self._offered is None:
            self._offered = PortReservation(self.context.host)
        return self._offered.port

    def _hand_over_port(self, assignment: dict[str, Any]) -> None:
        """A round that serves its store on this node's offered port keeps that port held; the next
        round is offered a fresh one. (A repeated assignment names the handed port, not the offered
        one, and idle/finish assignments name none, so this is a no-op for them.)"""
        if self._offered is not None and assignment.get("port") == self._offered.port:
            if self._handed is not None:
                self._handed.release()
            self._handed, self._offered = self._offered, None
            self._handed.serve_store()

    def _release_ports(self) -> None:
        for reservation in (self._offered, self._handed):
            if reservation is not None:
                reservation.release()
        self._offered = self._handed = None

    def _sync(self, report: dict[str, Any]) -> dict[str, Any] | None:
        try:
            if self._client is None:
                self._client = self._connect()
                if self._client is None:
                    return None
            reply: dict[str, Any] = self._client.call("call", "elastic_sync", report, timeout_s=5.0)
            self._synced_at = time.monotonic()
            return reply
        except RlplexError as error:
            # The master counts a member lost after member_timeout_s without a sync: the node's log
            # must say whether this agent was trying (and failing) or not running at all.
            now = time.monotonic()
            if now - self._complained_at > 5.0:
                self._complained_at = now
                print(f"{self.context.node_id}: sync with the master failed ({error}); last sync "
                      f"{now - self._synced_at:.1f} s ago", flush=True)  # fmt: skip
            if self._client is not None:
                self._client.close()
            self._client = None  # the master may have moved (restarted): look it up again
            return None

    def _connect(self) -> RpcClient | None:
        with JobStore.open_readonly(self.context.output_dir, self.context.job_id) as job:
            records = job.nodes(self.master_role)
        if records and all(n.state == NodeState.FINISHED for n in records):
            # Every script exited 0 before this node joined (a role scaled up as the work ended):
            # no round will come, and waiting for one would keep the job running for ever.
            if not self._finished:
                print(f"{self.context.node_id}: the elastic master finished before this node joined", flush=True)
            self._finished = True
            return None
        masters = [n for n in records if n.address]
        if not masters:
            return None
        return RpcClient(parse_address(masters[0].address), self.context.token, masters[0].node_id, 5.0)

    def _reconcile(self, assignment: dict[str, Any]) -> None:
        action, epoch = str(assignment["action"]), str(assignment["epoch"])
        if self._script is not None and not (action == RUN and epoch == self._script_epoch):
            self._stop_script(abort=bool(assignment.get("abort")))
        if self._check is not None and not (action == CHECK and epoch == self._check_epoch):
            self._stop_check()
        self._hand_over_port(assignment)
        if action == CHECK and epoch != self._check_epoch:
            self._check_epoch, self._check_result = epoch, None
            self._check_result = self.start_node_check(assignment)
        elif action == RUN and epoch != self._script_epoch:
            self._start_script(assignment)
        elif action == FINISH and self._script is None:
            self._finished = True

    # ---- the node check ----------------------------------------------------------------------
    def start_node_check(self, assignment: dict[str, Any]) -> dict[str, Any] | None:
        """Launch the check process; None while it runs (its outcome comes with a later report).

        A subclass may return a result at once instead (tests inject failing checks so)."""
        env = {**os.environ, **dist_env(assignment), "OMP_NUM_THREADS": str(self.config.omp_num_threads)}
        argv = ["--size", str(assignment["matmul_size"]), "--timeout-s", str(assignment["check_timeout_s"])]
        argv += ["--backend", str(assignment.get("backend", "gloo"))]
        self.check_file.parent.mkdir(parents=True, exist_ok=True)
        self.check_file.unlink(missing_ok=True)
        request = ForkRequest(call="rlplex.control.elastic.check:main", argv=argv, env=env, cwd=os.getcwd(),
                              stdout=str(self.check_file), die_with_server=True)  # fmt: skip
        self._check = self._fork_server().launch(request)
        return None

    def _check_outcome(self, check: ChildProcess) -> dict[str, Any]:
        try:
            out = self.check_file.read_text(errors="replace")
        except OSError:
            out = ""
        for line in reversed(out.strip().splitlines()):
            try:
                result = json.loads(line)
            except ValueError:
                continue
            if isinstance(result, dict) and "ok" in result:
                return result
        return {"ok": False, "error": f"node check process exited with code {check.returncode} without a result"}

    def _stop_check(self) -> None:
        if self._check is not None:
            kill_tree(self._check, 0.0)
            self._check = None

    def _fork_server(self) -> ForkServer:
        """The node's fork server, started at the first check or script (from the agent thread,
        whose end kills it), and again if it has gone."""
        if self._forker is None or not self._forker.running:
            if self._forker is not None:
                self._forker.close()
            preload = [*SCRIPT_PRELOAD]
            if self.config.entrypoint is not None:
                preload.append(self.config.entrypoint.split(":", 1)[0])
            env = {**os.environ, "OMP_NUM_THREADS": str(self.config.omp_num_threads), **self.config.env}
            self._forker = ForkServer(preload, env, command=fork_server_command(), new_session=False)
        return self._forker

    # ---- the script --------------------------------------------------------------------------
    def _start_script(self, assignment: dict[str, Any]) -> None:
        restarts = str(assignment["restarts"])
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(self.config.omp_num_threads),
            **self.config.env,
            **dist_env(assignment),
            "RLPLEX_RESTART_COUNT": restarts,
            "TORCHELASTIC_RESTART_COUNT": restarts,
            "TORCHELASTIC_RUN_ID": self.context.job_id,
            "RLPLEX_CHECKPOINT_DIR": str(self.checkpoint_dir),
            "RLPLEX_PROGRESS_FILE": str(self.progress_file),
        }
        if self._stop_asked:
            env[STOP_ENV] = "1"
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.progress_file.unlink(missing_ok=True)  # progress of an earlier epoch must not count for this one
        target: dict[str, Any]
        if self.config.entrypoint is not None:
            # The entrypoint's config crosses into the script once, as its JSON, on stdin.
            target = {"call": "rlplex.control.elastic.entry:main", "argv": [self.config.entrypoint, *self.config.args],
                      "stdin": json.dumps(self.config.config)}  # fmt: skip
        elif self.config.module is not None:
            target = {"module": self.config.module, "argv": list(self.config.args)}
        else:
            target = {"path": str(self.config.script), "argv": list(self.config.args)}
        request = ForkRequest(**target, env=env, cwd=os.getcwd(), die_with_server=True)
        print(f"{self.context.node_id}: epoch {assignment['epoch']}: rank {assignment['rank']} of "
              f"{assignment['world']}, port {assignment['port']}, restart {restarts}: {request.command()}",
              flush=True)  # fmt: skip
        self._script = self._fork_server().launch(request)
        self._script_epoch, self._script_exit = str(assignment["epoch"]), None

    def _stop_script(self, abort: bool = False) -> None:
        if self._script is not None:
            grace = self.config.abort_grace_s if abort else self.config.stop_grace_s
            self._script_exit = kill_tree(self._script, grace)
            self._script = None
