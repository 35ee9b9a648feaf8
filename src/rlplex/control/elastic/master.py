"""`ElasticMaster`: the sub-master of the seed's elastic training (sub-master driven pattern).

It owns the rendezvous of one role of `ElasticWorker`s (`config.workers`), as the explicit state
machine of `rdzv` (WAITING -> CHECKING -> READY -> RUNNING -> RESTARTING -> ...):

- `check_child()` (during the job's prepare) gathers the members, runs the node check on them
  (gloo all-reduce + matmul timing; slow nodes are reported, a failing one fails prepare with
  the reason) and leaves the rendezvous READY.
- `start()` runs the scripts with ranks 0..n-1 (members in role-rank order) and a fresh port,
  then watches them. A lost member (its node died or was restarted by the PrimeManager's
  policy, or it went silent), a failed script, or a new member makes it re-rendezvous: stop
  every surviving script, wait for the replacement (or go on with the survivors when
  `min_nodes` allows), check newcomers, restart every script with the new world; the user's
  script resumes from its own last checkpoint.
- When every script exited 0, every worker is told to finish, and the master finishes.

The state, members, checks and timings are in `<output_dir>/elastic/<node_id>.json`; every
transition is recorded in the job store as entity '<node_id>:rendezvous'.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from rlplex.control.elastic.rdzv import (
    CHECK,
    FINISH,
    IDLE,
    RDZV_TRANSITIONS,
    RUN,
    ElasticConfig,
    Member,
    RendezvousError,
    RendezvousState,
    RoundEnd,
    failed_checks,
    local_layout,
    parse_role_config,
    rendezvous_endpoint,
    slow_nodes,
)
from rlplex.control.elastic.worker import ElasticWorker, elastic_dir
from rlplex.control.job.states import NodeState, StateMachine
from rlplex.control.job.store import SqliteStateStore
from rlplex.control.node.worker import SubMaster, WorkerContext

__all__ = ["ElasticMaster", "ElasticWorker", "RendezvousError", "RendezvousState"]

R = RendezvousState
_LIVE_NODE = (NodeState.CREATED, NodeState.CHECKED, NodeState.RUNNING)


class _Stopped(Exception):
    """The master was told to stop: leave the loop quietly."""


class ElasticMaster(SubMaster):
    config_model = ElasticConfig

    def __init__(self, context: WorkerContext) -> None:
        super().__init__(context)
        self.config: ElasticConfig = parse_role_config(ElasticConfig, context.config, context.role)
        count = context.world.get(self.config.workers, 0)
        self.min_nodes = self.config.min_nodes or max(1, count)
        self.max_nodes = self.config.max_nodes or max(1, count)
        self.store = SqliteStateStore.in_dir(context.output_dir, create=False)
        # check_child() is one control RPC of the PrimeManager: it must answer within the job's timeout.
        self.rpc_timeout_s = float(json.loads(self.store.job(context.job_id).spec_json)["rpc_timeout_s"])
        self._prepare_deadline: float | None = None
        self.machine = StateMachine(
            RDZV_TRANSITIONS, R.INIT, self.store, context.job_id, f"{context.node_id}:rendezvous"
        )
        self.status_file = elastic_dir(context.output_dir) / f"{context.node_id}.json"
        self.status_file.parent.mkdir(parents=True, exist_ok=True)
        previous = self._load_previous()
        # A restarted master keeps counting: restarts against the budget, and epochs the workers compare.
        self.restarts: int = int(previous.get("restarts", 0))
        self._epoch_n: int = int(previous.get("epoch_n", 0))
        self.history: list[dict[str, Any]] = list(previous.get("history", []))
        self.rounds: list[dict[str, Any]] = list(previous.get("rounds", []))
        if previous.get("state") not in (None, R.FINISHED.value, R.FAILED.value):
            # A previous master of this role died mid-rendezvous: its scripts are stopped and started
            # again by this one, which costs a restart like any other loss.
            self.restarts += 1
        self.checks: dict[str, dict[str, Any]] = {}
        self.slow: dict[str, str] = {}
        self._lock = threading.RLock()
        self._members: dict[str, Member] = {}
        self._assign: dict[str, dict[str, Any]] = {}
        self._round: dict[str, int] = {}  # node_id -> incarnation of the running round
        self._ready: list[Member] = []
        self._thread: threading.Thread | None = None
        self._last_status_write = 0.0
        self._log(f"elastic master for role '{self.config.workers}': min_nodes {self.min_nodes}, "
                  f"max_nodes {self.max_nodes}, restarts so far {self.restarts}")  # fmt: skip

    def _load_previous(self) -> dict[str, Any]:
        try:
            data = json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            return {}
        # Only a previous master of this job counts (the folder may hold an earlier job's file).
        return data if isinstance(data, dict) and data.get("job_id") == self.context.job_id else {}

    # ---- hooks -------------------------------------------------------------------------------
    def status(self) -> str:
        if self.machine.state == R.FAILED:
            return NodeState.FAILED
        if self.machine.state == R.FINISHED:
            return NodeState.FINISHED
        return self._state

    def check_child(self) -> None:
        try:
            if self.restarts > self.config.max_restarts:
                raise RendezvousError(f"restart budget spent ({self.config.max_restarts}) before this master started")
            cause = "initial rendezvous" if self.restarts == 0 else f"taking over after restart #{self.restarts}"
            self._prepare_deadline = time.monotonic() + self.rpc_timeout_s - 1.0
            self._ready = self._rendezvous(cause, initial=True)
        except _Stopped:
            raise RendezvousError("stopped during the initial rendezvous") from None
        except Exception as error:
            self._fail(str(error))
            raise
        finally:
            self._prepare_deadline = None

    def start(self) -> None:
        super().start()
        self._thread = threading.Thread(target=self._main, name=f"{self.context.node_id}-rdzv", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        super().stop()
        with self._lock:
            self._assign = {}

    # ---- the workers' side (called over the control RPC, one thread per worker) -----------------
    def elastic_sync(self, report: dict[str, Any]) -> dict[str, Any]:
        """A worker's report in, its assignment out."""
        now = time.monotonic()
        node_id, incarnation = str(report["node_id"]), int(report["incarnation"])
        with self._lock:
            member = self._members.get(node_id)
            if member is None or incarnation > member.incarnation:
                member = Member(node_id, int(report["rank"]), incarnation, now)
                self._members[node_id] = member
            elif incarnation < member.incarnation:
                return {"epoch": "", "action": IDLE}  # a stale process: it must do nothing
            member.last_sync, member.report = now, report
            member.syncs += 1
            return self._assign.get(node_id, {"epoch": self._epoch(), "action": IDLE})

    # ---- the rendezvous state machine --------------------------------------------------------
    def _main(self) -> None:
        try:
            members = self._ready
            while True:
                self._launch(members)
                ended = self._watch()
                if ended is None:
                    self._finish()
                    return
                cause = ended.cause
                self._to(R.RESTARTING, cause)
                self.restarts += 1
                if self.restarts > self.config.max_restarts:
                    raise RendezvousError(f"restart budget spent ({self.config.max_restarts}); last cause: {cause}")
                self._stop_scripts(abort=ended.rank_lost)
                members = self._rendezvous(f"re-rendezvous #{self.restarts}: {cause}", initial=False)
        except _Stopped:
            return
        except Exception as error:
            self._fail(f"{type(error).__name__}: {error}" if not isinstance(error, RendezvousError) else str(error))

    def _rendezvous(self, cause: str, initial: bool) -> list[Member]:
        while True:
            members = self._gather(cause)
            new = [m for m in members if not m.checked]
            if self.config.node_check and new and not self._node_check(new, initial):
                cause = "a member failed its node check"
                continue
            for member in members:
                member.checked = True
            ranks = ", ".join(f"{m.node_id}={i}" for i, m in enumerate(members))
            checked = f"; checked {[m.node_id for m in new]}" if new else ""
            self._to(R.READY, f"{len(members)} members ({ranks}){checked}")
            return members

    def _gather(self, cause: str) -> list[Member]:
        self._to(R.WAITING, cause)
        start = time.monotonic()
        while True:
            self._pause()
            view = self._store_view()
            live = self._live(view)
            expected = min(self.max_nodes, sum(1 for state, _inc in view.values() if state != NodeState.STOPPED))
            waited = time.monotonic() - start
            if live and len(live) >= expected:
                break
            if waited > self.config.join_timeout_s and len(live) >= self.min_nodes:
                self._log(f"going on with {len(live)} of {expected} expected members after {waited:.1f} s")
                break
            if waited > max(self.config.join_timeout_s, self.config.rendezvous_timeout_s):
                raise RendezvousError(
                    f"only {len(live)} live members of role '{self.config.workers}' after {waited:.0f} s "
                    f"(min_nodes {self.min_nodes}, expected {expected})"
                )
        return sorted(live, key=lambda m: m.rank)[: self.max_nodes]

    def _node_check(self, members: list[Member], initial: bool) -> bool:
        names = [m.node_id for m in members]
        self._to(R.CHECKING, f"node check of {names}")
        epoch, world = self._new_epoch(), len(members)
        addr, port = self._endpoint(members[0])
        timeout = self.config.check_timeout_s
        layout = self._layout(members)
        with self._lock:
            self._assign = {
                m.node_id: {"epoch": epoch, "action": CHECK, "rank": i, "world": world, "addr": addr, "port": port,
                            "matmul_size": self.config.matmul_size, "check_timeout_s": timeout,
                            "backend": self.config.dist_backend, **layout[i]}
                for i, m in enumerate(members)
            }  # fmt: skip
        results: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout + 5.0
        while len(results) < world and not failed_checks(results):
            self._pause()
            view = self._store_view()
            for member in members:
                current = self._members.get(member.node_id)
                lost = self._lost(current, member.incarnation, view)
                check = current.report.get("check", {}) if current is not None else {}
                if lost is not None:
                    results[member.node_id] = {"ok": False, "error": f"lost during the check: {lost}"}
                elif check.get("epoch") == epoch and check.get("result") is not None:
                    results[member.node_id] = dict(check["result"])
            if time.monotonic() > deadline:
                for name in names:
                    results.setdefault(name, {"ok": False, "error": f"no node check result within {timeout:g} s"})
        with self._lock:
            self._assign = {}  # stops the checks still waiting on a failed peer
        self.checks.update(results)
        failures = failed_checks(results)
        self.slow.update(slow_nodes(results, self.config.slow_factor))
        for name, why in slow_nodes(results, self.config.slow_factor).items():
            self._log(f"slow node {name}: {why}")
        for name, result in results.items():
            self._log(f"node check {name}: {result}")
        if failures:
            reason = "; ".join(f"{name}: {why}" for name, why in failures.items())
            if initial:
                raise RendezvousError(f"node check failed: {reason}")
            for member in members:
                if member.node_id in failures:
                    member.excluded = f"failed its node check: {failures[member.node_id]}"
            self._to(R.WAITING, f"node check failed, members excluded: {reason}")
            return False
        return True

    def _launch(self, members: list[Member]) -> None:
        epoch, world = self._new_epoch(), len(members)
        addr, port = self._endpoint(members[0])
        layout = self._layout(members)
        with self._lock:
            self._round = {m.node_id: m.incarnation for m in members}
            self._assign = {
                m.node_id: {"epoch": epoch, "action": RUN, "rank": i, "world": world, "addr": addr, "port": port,
                            "restarts": self.restarts, **layout[i]}
                for i, m in enumerate(members)
            }  # fmt: skip
        self.rounds.append({"epoch": epoch, "restarts": self.restarts, "world": world, "addr": addr, "port": port,
                            "ranks": {m.node_id: i for i, m in enumerate(members)}, "started_at": time.time(),
                            "resumed_from": None, "first_step_at": None})  # fmt: skip
        self._to(R.RUNNING, f"world {world}, rank 0 at {addr}:{port}, restart {self.restarts}")

    def _layout(self, members: list[Member]) -> list[dict[str, int]]:
        """LOCAL_RANK and friends: members reporting the same endpoint host share a machine."""
        with self._lock:
            hosts = [str((m.report.get("endpoint") or {}).get("host", "")) for m in members]
        return local_layout(hosts)

    def _endpoint(self, rank0: Member) -> tuple[str, int]:
        with self._lock:
            report = rank0.report
        return rendezvous_endpoint(rank0.node_id, report)

    def _watch(self) -> RoundEnd | None:
        """Until every script exited 0 (None) or the round must restart (why)."""
        epoch, round_info = self._epoch(), self.rounds[-1]
        while True:
            self._pause()
            view, now = self._store_view(), time.monotonic()
            done, steps = True, []
            for node_id, incarnation in self._round.items():
                member = self._members.get(node_id)
                lost = self._lost(member, incarnation, view)
                rank = round_info["ranks"][node_id]
                if lost is not None or member is None:
                    return RoundEnd(f"member {node_id} (rank {rank}) lost: {lost}", rank_lost=True)
                script, progress = member.report.get("script", {}), member.report.get("progress") or {}
                if script.get("epoch") != epoch or script.get("running") or script.get("exit") is None:
                    done = False
                elif script["exit"] != 0:
                    failed = f"rank {rank} ({node_id}): script exited with code {script['exit']}"
                    return RoundEnd(failed, rank_lost=True)
                if script.get("epoch") == epoch and "step" in progress:
                    steps.append(progress["step"])
                    start = progress.get("resumed_from", 0.0)
                    if round_info["resumed_from"] is None:
                        round_info["resumed_from"] = start
                    if round_info["first_step_at"] is None and progress["step"] > start:
                        round_info["first_step_at"] = time.time()
            if done:
                return None
            if steps:
                self.context.report_progress(step=min(steps), world=len(self._round), restarts=self.restarts)
            joined = [m for m in self._live(view) if m.node_id not in self._round]
            if joined and len(self._round) < self.max_nodes:
                return RoundEnd(f"{[m.node_id for m in joined]} joined; growing the world", rank_lost=False)
            if now - self._last_status_write > 1.0:
                self._write_status()

    def _stop_scripts(self, abort: bool) -> None:
        """Every script of the round stops: gracefully (`stop_grace_s`) when the world grows, with
        `abort_grace_s` when a rank was lost (`abort`), whose peers cannot finish a collective or a
        store wait on it: a survivor blocked in one hears no SIGTERM until it is killed."""
        with self._lock:
            idle = {"epoch": self._epoch(), "action": IDLE, "abort": True}
            self._assign = {node_id: dict(idle) for node_id in self._round} if abort else {}
            marks = {n: m.syncs for n, m in self._members.items()}
        deadline = time.monotonic() + self.config.stop_timeout_s
        while time.monotonic() < deadline:
            self._pause()
            view = self._store_view()
            running = [
                m.node_id for m in self._live(view)
                if m.syncs < marks.get(m.node_id, 0) + 2 or m.report.get("script", {}).get("running")
            ]  # fmt: skip
            if not running:
                return
        self._log(f"scripts still running after {self.config.stop_timeout_s:g} s; going on")

    def _finish(self) -> None:
        with self._lock:
            self._assign = {n: {"epoch": self._epoch(), "action": FINISH} for n in self._round}
        deadline = time.monotonic() + self.config.stop_timeout_s
        while time.monotonic() < deadline:
            self._pause()
            view = self._store_view()
            waiting = [
                n for n, inc in self._round.items()
                if self._lost(self._members.get(n), inc, view) is None
                and not self._members[n].report.get("finished") and view.get(n, ("", 0))[0] != NodeState.FINISHED
            ]  # fmt: skip
            if not waiting:
                break
        self._to(R.FINISHED, f"every script exited 0 ({self.restarts} restarts)")

    # ---- membership --------------------------------------------------------------------------
    def _store_view(self) -> dict[str, tuple[str, int]]:
        return {
            n.node_id: (n.state, n.incarnation) for n in self.store.nodes(self.context.job_id)
            if n.role == self.config.workers
        }  # fmt: skip

    def _lost(self, member: Member | None, incarnation: int, view: dict[str, tuple[str, int]]) -> str | None:
        """Why this member (of `incarnation`) can no longer train, or None."""
        if member is None:
            return "never joined"
        if member.incarnation != incarnation:
            return f"replaced by incarnation {member.incarnation}"
        if member.excluded:
            return member.excluded
        state, stored = view.get(member.node_id, ("", -1))
        if stored != incarnation:
            return f"node restarted (incarnation {stored})"
        if state not in _LIVE_NODE and state != NodeState.FINISHED:
            return f"node is {state or 'gone'}"
        silent = time.monotonic() - member.last_sync
        if silent > self.config.member_timeout_s:
            return f"no sync for {silent:.1f} s"
        return None

    def _live(self, view: dict[str, tuple[str, int]]) -> list[Member]:
        with self._lock:
            members = list(self._members.values())
        return [m for m in members if self._lost(m, m.incarnation, view) is None]

    # ---- bookkeeping -------------------------------------------------------------------------
    def _pause(self) -> None:
        if self.context.stop_event.wait(self.config.poll_interval_s):
            raise _Stopped
        if self._prepare_deadline is not None and time.monotonic() > self._prepare_deadline:
            raise RendezvousError(
                f"the initial rendezvous was still {self.machine.state.value} at the end of the job's "
                f"rpc_timeout_s ({self.rpc_timeout_s:g} s), the limit of check_child(); raise rpc_timeout_s "
                "(the node check imports torch on every rank)"
            )

    def _epoch(self) -> str:
        return f"{self.context.incarnation}.{self._epoch_n}"

    def _new_epoch(self) -> str:
        self._epoch_n += 1
        return self._epoch()

    def _to(self, state: RendezvousState, cause: str) -> None:
        if self.machine.state == state:
            return
        old = self.machine.state
        self.machine.transition(state, cause)
        self.history.append({"old": old.value, "new": state.value, "cause": cause, "at": time.time()})
        self._log(f"rendezvous {old.value} -> {state.value}: {cause}")
        self._write_status()

    def _fail(self, cause: str) -> None:
        self.error = f"elastic rendezvous failed: {cause}"
        with self._lock:
            self._assign = {}
        if self.machine.can(R.FAILED):
            self._to(R.FAILED, cause)

    def _log(self, message: str) -> None:
        print(f"{self.context.node_id}: {message}", flush=True)

    def _write_status(self) -> None:
        self._last_status_write = time.monotonic()
        with self._lock:
            members = {
                n: {"rank": m.rank, "incarnation": m.incarnation, "checked": m.checked, "excluded": m.excluded,
                    "script": m.report.get("script"), "progress": m.report.get("progress")}
                for n, m in self._members.items()
            }  # fmt: skip
        status = {
            "job_id": self.context.job_id,
            "node_id": self.context.node_id,
            "workers": self.config.workers,
            "state": self.machine.state.value,
            "epoch": self._epoch(),
            "epoch_n": self._epoch_n,
            "restarts": self.restarts,
            "min_nodes": self.min_nodes,
            "max_nodes": self.max_nodes,
            "members": members,
            "checks": self.checks,
            "slow": self.slow,
            "rounds": self.rounds,
            "history": self.history,
            "error": self.error,
        }
        write_json_atomic(self.status_file, status)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def read_elastic_status(output_dir: str | Path, node_id: str = "elastic-0") -> dict[str, Any]:
    """The status an ElasticMaster last wrote ({} before it wrote one)."""
    try:
        data = json.loads((elastic_dir(Path(output_dir)) / f"{node_id}.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def rendezvous_summaries(output_dir: str | Path) -> list[str]:
    """One line per ElasticMaster of the job in `output_dir` (for `rlplex job status`)."""
    lines = []
    for path in sorted(elastic_dir(Path(output_dir)).glob("*.json")):
        status = read_elastic_status(output_dir, path.stem)
        if "state" not in status:
            continue
        rounds = status.get("rounds") or [{}]
        line = (
            f"{status['node_id']} (role '{status.get('workers')}'): rendezvous {status['state']}, "
            f"world {rounds[-1].get('world', 0)}, restarts {status.get('restarts', 0)}, epoch {status.get('epoch')}"
        )
        if status.get("slow"):
            line += f"; slow nodes: {status['slow']}"
        if status.get("error"):
            line += f"; {status['error']}"
        lines.append(line)
    return lines
