"""`PrimeManager`: the control loop of one job, following the seed's sequence diagram.

    prepare():  Placement.allocate -> Scheduler.create_nodes -> (per node, as each says hello)
                status() ping -> self_check() -> check_child() [sub-masters]   => job READY
    start():    start() on every node, workers, sub-masters, then drivers  => job RUNNING
    monitor():  one step: drain pushed events, bring restarted nodes up, build a frozen
                JobStatus, ask the FailurePolicy, carry out and record its Decision, finish
                the job when every driver (else every node) has finished
    stop():     stop() on every node, kill what is left, Scheduler.cleanup()  => job STOPPED

A prepare that fails at any point cleans up everything it created. Every transition and
decision goes to the store (and to `<output_dir>/master.log`) with its cause.

Crash safety (a master may die at any line; `reattach()` in the resumed master picks up):
- a restart decision is one store transaction: the decision, the budget spent, every chosen
  node's FAILED/STOPPED -> PENDING with its new incarnation (and the job's READY for a job
  restart). Processes are launched after the commit; each launch is recorded with its CREATED
  transition in one transaction. `reattach()` relaunches PENDING nodes (decided, launch not
  recorded) under a fresh incarnation, so that a process the dead master may have launched
  is stale and stops itself; a FAILED node (failure recorded, restart not) is restarted.
- a node's final message is acknowledged only after its FINISHED is stored: the node
  exits on the acknowledgement, and otherwise tells the resumed master again.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from typing import Any

from rlplex.control.backends.scheduler import NodeEvent, Scheduler
from rlplex.control.job.health import (
    Action,
    Decision,
    DefaultFailurePolicy,
    FailurePolicy,
    JobStatus,
    NodeStatus,
    RoleStatus,
    detect_failure,
)
from rlplex.control.job.placement import Bundle, Member, Placement, node_id
from rlplex.control.job.spec import JobSpec
from rlplex.control.job.states import LIVE_NODE_STATES, TERMINAL_JOB_STATES, JobState, NodeState, WorkDone, job_machine
from rlplex.control.job.store import StateStore
from rlplex.control.node.slot import NodeInfo, NodeSlot
from rlplex.errors import JobFailedError, JobSpecError, PlacementError, RlplexError

logger = logging.getLogger("rlplex.control")
_HEARTBEAT_FLUSH_S = 1.0


class PrimeManager:
    def __init__(
        self,
        spec: JobSpec,
        job_id: str,
        store: StateStore,
        scheduler: Scheduler,
        policy: FailurePolicy | None = None,
        state: JobState = JobState.INIT,
    ) -> None:
        self.spec, self.job_id, self.store, self.scheduler = spec, job_id, store, scheduler
        self.policy: FailurePolicy = policy or DefaultFailurePolicy()
        self.job = job_machine(store, job_id, state)
        self.slots: dict[str, NodeSlot] = {}
        self._failover = False
        self._finals: list[tuple[str, int, str]] = []  # (node, incarnation, status) read, not yet acknowledged
        self._spent: dict[str, int] | None = None
        self._last_flush = time.monotonic()
        self._log_file = open(spec.output_dir / "master.log", "a", buffering=1)

    @property
    def failover_pending(self) -> bool:
        """True between a failover (job restart, master resume) and the job running again."""
        return self._failover

    # ---- bookkeeping -------------------------------------------------------------------------
    def log(self, message: str) -> None:
        logger.info("job %s: %s", self.job_id, message)
        self._log_file.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}\n")

    def _job_to(self, state: JobState, cause: str) -> None:
        self.job.transition(state, cause)
        self.log(f"job -> {state.value}: {cause}")

    def _to_pending(self, slot: NodeSlot, cause: str) -> None:
        """PENDING with the incarnation it will be launched under, in one transaction."""
        with self.store.transaction():
            if slot.state == NodeState.PENDING:  # a relaunch under a new incarnation (master failover)
                self.store.record_transition(self.job_id, slot.node_id, NodeState.PENDING, NodeState.PENDING, cause)
            else:
                slot.to(NodeState.PENDING, cause)
            self.store.update_node(
                self.job_id, slot.node_id, incarnation=slot.incarnation, restarts=slot.restarts, pid=0, address=""
            )

    def _register(self, member: Member) -> NodeSlot:
        slot = NodeSlot.new(self.store, self.job_id, member.role, member.rank, self.spec.roles[member.role].kind)
        self.slots[slot.node_id] = slot
        self.store.add_node(self.job_id, slot.node_id, slot.role, slot.rank, NodeState.PENDING.value)
        return slot

    def _launch(self, bundles: list[Bundle]) -> None:
        members = [self.slots[m.node_id] for b in bundles for m in b.members]
        handles = self.scheduler.create_nodes(bundles, {s.node_id: s.incarnation for s in members})
        for handle in handles:
            self.slots[handle.node_id].launched(handle, self.store, self.job_id)

    # ---- the seed's lifecycle -----------------------------------------------------------------
    def prepare(self) -> None:
        """Place, create and check every node; on any failure clean up everything and raise."""
        try:
            bundles = Placement.allocate(self.spec)
        except PlacementError as error:
            self._job_to(JobState.FAILED, f"placement refused: {error}")
            raise
        try:
            for bundle in bundles:
                for member in bundle.members:
                    self._register(member)
            self._launch(bundles)
            deadline = time.monotonic() + self.spec.start_timeout_s
            while any(s.state == NodeState.CREATED for s in self.slots.values()):
                self._step_nodes()
                self._acknowledge_finals()
                for slot in self.slots.values():
                    cause = detect_failure(self._node_status(slot, time.monotonic()))
                    if cause is not None:
                        tail = self.scheduler.log_tail(slot.handle) if slot.handle else ""
                        raise JobFailedError(f"prepare failed: node {slot.node_id}: {cause}. log: {tail}")
                waiting = [s.node_id for s in self.slots.values() if s.state == NodeState.CREATED]
                if waiting and time.monotonic() > deadline:
                    raise JobFailedError(f"prepare failed: {waiting} not ready within {self.spec.start_timeout_s} s")
                time.sleep(self.spec.monitor_interval_s / 2)
            self._job_to(JobState.READY, f"{len(self.slots)} nodes created and checked")
        except BaseException as error:
            self.fail(str(error) if isinstance(error, RlplexError) else f"prepare failed: {error!r}")
            raise

    def start(self) -> None:
        for role in self.spec.role_order():
            for slot in self.slots.values():
                if slot.role == role and slot.state == NodeState.CHECKED:
                    self._start_node(slot)
        self._job_to(JobState.RUNNING, "every node started")

    def monitor(self) -> JobState:
        """One step of the control loop; returns the job's state after it."""
        if self.job.state in TERMINAL_JOB_STATES:
            return self.job.state
        self._step_nodes()
        self._acknowledge_finals()
        if self.job.state == JobState.READY and self._failover:
            self._finish_failover()
        # Checking or starting a node is a blocking call (a self_check may load a model for
        # seconds): take the heartbeats that arrived meanwhile before judging anyone's silence.
        self._drain()
        decision = self.policy.decide(self.status())
        if decision.action != Action.NONE:
            self._execute(decision)
        if self.job.state == JobState.RUNNING and self._done():
            self.stop(WorkDone.DRIVERS_FINISHED if self._has_drivers() else WorkDone.NODES_FINISHED)
        self._flush_heartbeats()
        return self.job.state

    def stop(self, cause: str = "stopped by the user") -> None:
        if self.job.state in TERMINAL_JOB_STATES:
            return
        if self.job.can(JobState.STOPPING):
            self._job_to(JobState.STOPPING, cause)
        self._stop_nodes(list(self.slots.values()), cause)
        self.scheduler.cleanup()
        self._remove_channels()
        self._flush_heartbeats(force=True)
        if self.job.can(JobState.STOPPED):
            self._job_to(JobState.STOPPED, cause)
        else:
            self._job_to(JobState.FAILED, cause)

    def fail(self, cause: str) -> None:
        """Fail the job: kill every node, record the cause."""
        if self.job.state in TERMINAL_JOB_STATES:
            return
        for slot in self.slots.values():
            if slot.handle is not None:
                self.scheduler.kill(slot.handle)
            if slot.state in LIVE_NODE_STATES or slot.state == NodeState.PENDING:
                slot.to(NodeState.STOPPED, f"job failed: {cause}")
        self.scheduler.cleanup()
        self._remove_channels()
        self._flush_heartbeats(force=True)
        self._job_to(JobState.FAILED, cause)

    def close(self) -> None:
        self._log_file.close()

    def _remove_channels(self) -> None:
        """The job's channels (`WorkerContext.channel_name`) outlive every node by design; not the job."""
        from rlplex.control.channels.stage import remove_job_channels

        remove_job_channels(self.job_id, on_ray=self.spec.backend == "ray")

    # ---- node steps ---------------------------------------------------------------------------
    def _drain(self) -> None:
        for event in self.scheduler.events():
            slot = self.slots.get(event.node_id)
            if slot is not None and event.incarnation == slot.incarnation:
                self._apply(slot, event)
            if event.kind == "final":
                self._finals.append((event.node_id, event.incarnation, str(event.payload.get("status"))))

    def _acknowledge_finals(self) -> None:
        """Acknowledge the final messages whose verdict is stored; a FINISHED one once the node is FINISHED.

        (Other finals, and those of stale incarnations, carry nothing a restart would repeat.)"""
        waiting = []
        for node, incarnation, status in self._finals:
            slot = self.slots.get(node)
            current = slot is not None and slot.incarnation == incarnation
            if current and status == NodeState.FINISHED and slot is not None and slot.state in LIVE_NODE_STATES:
                waiting.append((node, incarnation, status))
                continue
            self.scheduler.acknowledge(node, incarnation)
        self._finals = waiting

    def _apply(self, slot: NodeSlot, event: NodeEvent) -> None:
        if event.kind == "hello":
            slot.address, slot.connected = str(event.payload["address"]), True
            slot.last_heartbeat = event.at
            pid = int(event.payload.get("pid", 0))
            if slot.handle is not None and not slot.handle.pid and pid:
                slot.handle.pid = pid  # backends that learn the pid from the node itself (Ray actors)
                self.store.update_node(self.job_id, slot.node_id, address=slot.address, pid=pid)
            else:
                self.store.update_node(self.job_id, slot.node_id, address=slot.address)
        elif event.kind in ("heartbeat", "final"):
            slot.heartbeat(event.payload, event.at)
        elif event.kind == "closed":
            slot.connected = False

    def _step_nodes(self) -> None:
        self._drain()
        for slot in list(self.slots.values()):
            if slot.state == NodeState.CREATED and slot.address and slot.reported != NodeState.FAILED:
                self._check_node(slot)
            if slot.state == NodeState.CHECKED and self.job.state == JobState.RUNNING:
                self._start_node(slot)
            if slot.state in LIVE_NODE_STATES and slot.reported == NodeState.FINISHED:
                slot.to(NodeState.FINISHED, "the node reported FINISHED")

    def _check_node(self, slot: NodeSlot) -> None:
        assert slot.handle is not None
        try:
            if slot.client is None:
                slot.client = self.scheduler.client(slot.handle, slot.address)
            slot.reported = str(slot.client.call("status"))
            slot.client.call("self_check")
            if slot.kind == "submaster":
                slot.client.call("check_child")
        except RlplexError as error:
            slot.reported, slot.error = NodeState.FAILED, f"check failed: {error}"
            return
        slot.to(NodeState.CHECKED, "status(), self_check() passed" + (", check_child()" * (slot.kind == "submaster")))

    def _start_node(self, slot: NodeSlot) -> None:
        assert slot.client is not None
        try:
            slot.client.call("start")
        except RlplexError as error:
            slot.reported, slot.error = NodeState.FAILED, f"start() failed: {error}"
            return
        slot.progress_changed = time.monotonic()
        slot.last_heartbeat = max(slot.last_heartbeat, time.monotonic())
        slot.to(NodeState.RUNNING, "start() returned")

    def _stop_nodes(self, slots: list[NodeSlot], cause: str) -> None:
        live = [s for s in slots if s.state in LIVE_NODE_STATES and s.handle is not None]
        for slot in live:
            if slot.client is not None:
                try:
                    slot.client.call("stop", timeout_s=1.0)
                except RlplexError:
                    pass
        deadline = time.monotonic() + self.spec.stop_grace_s
        while time.monotonic() < deadline and any(self.scheduler.is_alive(s.handle) for s in live if s.handle):
            self._drain()  # the nodes wait for the acknowledgement of their final message to exit
            self._record_finished(live)
            self._acknowledge_finals()
            time.sleep(0.02)
        self._drain()
        self._record_finished(live)
        for slot in slots:
            if slot.handle is not None:
                self.scheduler.kill(slot.handle)
            if slot.client is not None:
                slot.client.close()
                slot.client = None
            if slot.state in LIVE_NODE_STATES or slot.state == NodeState.PENDING:
                slot.to(NodeState.STOPPED, cause)

    def _record_finished(self, slots: list[NodeSlot]) -> None:
        for slot in slots:
            if slot.state in (NodeState.CHECKED, NodeState.RUNNING) and slot.reported == NodeState.FINISHED:
                slot.to(NodeState.FINISHED, "the node reported FINISHED")

    def _decide_restart(self, slot: NodeSlot, cause: str) -> None:
        """The store side of a restart (inside the decision's transaction): the node PENDING, next incarnation."""
        if slot.state in LIVE_NODE_STATES:
            slot.to(NodeState.FAILED, cause)
        elif slot.state == NodeState.PENDING:
            slot.to(NodeState.STOPPED, cause)
        slot.reset_for_restart()
        self._to_pending(slot, f"restart #{slot.restarts}: {cause}")

    def _relaunch(self, slot: NodeSlot) -> None:
        """Launch a PENDING node under its incarnation (the process side of a restart)."""
        if slot.handle is not None:
            handle = self.scheduler.restart(slot.handle, slot.incarnation)
        else:
            bundle = Bundle(-1, 0.0, 0.0, 0, (), (Member(slot.role, slot.rank),))
            handle = self.scheduler.create_nodes([bundle], {slot.node_id: slot.incarnation})[0]
        slot.launched(handle, self.store, self.job_id)

    def _execute(self, decision: Decision) -> None:
        target = ",".join(decision.node_ids) or decision.role or "job"
        if decision.action == Action.FAIL_JOB:
            self.store.record_decision(self.job_id, decision.action.value, target, decision.cause)
            self.log(f"decision {decision.action.value} on {target}: {decision.cause}")
            self.fail(decision.cause)
            return
        if decision.action == Action.RESTART_WORKER:
            chosen = [self.slots[n] for n in decision.node_ids]
        elif decision.action == Action.RESTART_ROLE:
            chosen = [s for s in self.slots.values() if s.role == decision.role and s.state != NodeState.FINISHED]
        else:
            chosen = [s for s in self.slots.values() if s.state not in (NodeState.FINISHED, NodeState.STOPPED)]
        with self.store.transaction():
            self.store.record_decision(self.job_id, decision.action.value, target, decision.cause)
            self.store.spend_restart(self.job_id, decision.role or "")
            if decision.action == Action.RESTART_JOB and self.job.state == JobState.RUNNING:
                self._job_to(JobState.READY, f"failover (restart job): {decision.cause}")
            for slot in chosen:
                self._decide_restart(slot, decision.cause)
        self.log(f"decision {decision.action.value} on {target}: {decision.cause}")
        self._spent = self.store.role_restarts(self.job_id)
        if decision.action == Action.RESTART_JOB:
            self._failover = True
        for slot in chosen:
            self._relaunch(slot)

    def _finish_failover(self) -> None:
        live = [s for s in self.slots.values() if s.state in LIVE_NODE_STATES]
        if all(s.state != NodeState.CREATED for s in live):
            self._failover = False
            self.start()

    def _has_drivers(self) -> bool:
        return any(self.spec.roles[s.role].kind == "driver" for s in self.slots.values())

    def _done(self) -> bool:
        active = [s for s in self.slots.values() if s.state != NodeState.STOPPED]
        if self._has_drivers():
            active = [s for s in active if s.kind == "driver"]
        return all(s.state == NodeState.FINISHED for s in active)

    def _flush_heartbeats(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._last_flush < _HEARTBEAT_FLUSH_S:
            return
        self._last_flush = time.monotonic()
        rows = [(s.node_id, s.heartbeat_wall, s.progress) for s in self.slots.values() if s.dirty]
        self.store.update_heartbeats(self.job_id, rows)
        for slot in self.slots.values():
            slot.dirty = False

    # ---- status, registry, scaling ------------------------------------------------------------
    def _node_status(self, slot: NodeSlot, now: float) -> NodeStatus:
        role = self.spec.roles[slot.role]
        handle = slot.handle
        # The open heartbeat connection says alive for free; only a closed one costs a waitpid.
        alive = handle is not None and (slot.connected or self.scheduler.is_alive(handle))
        return NodeStatus(
            node_id=slot.node_id,
            role=slot.role,
            rank=slot.rank,
            state=slot.state,
            alive=alive,
            exit_code=None if alive or handle is None else self.scheduler.exit_code(handle),
            reported=slot.reported,
            error=slot.error,
            in_state_s=now - slot.since,
            heartbeat_age_s=now - slot.last_heartbeat,
            progress_age_s=now - slot.progress_changed,
            restarts=slot.restarts,
            heartbeat_timeout_s=role.heartbeat_timeout_s,
            progress_timeout_s=role.progress_timeout_s,
            start_timeout_s=self.spec.start_timeout_s,
        )

    def status(self) -> JobStatus:
        now = time.monotonic()
        if self._spent is None:  # read once; afterwards kept in step with every spend_restart
            self._spent = self.store.role_restarts(self.job_id)
        spent = self._spent
        nodes = Counter(slot.role for slot in self.slots.values())  # scaled-down slots stay: the most ever
        grown = {name: r.restart.per_node * max(0, nodes[name] - r.count) for name, r in self.spec.roles.items()}
        roles = tuple(
            RoleStatus(name, r.kind, r.restart.scope, r.restart.max_restarts + grown[name], spent.get(name, 0))
            for name, r in self.spec.roles.items()
        )
        return JobStatus(
            job_id=self.job_id,
            state=self.job.state,
            restarts=sum(spent.values()),
            max_restarts=self.spec.max_restarts + sum(grown.values()),
            roles=roles,
            nodes=tuple(self._node_status(s, now) for s in self.slots.values()),
        )

    def get_nodes_by_role(self) -> dict[str, list[NodeInfo]]:
        out: dict[str, list[NodeInfo]] = {name: [] for name in self.spec.roles}
        for slot in sorted(self.slots.values(), key=lambda s: (s.role, s.rank)):
            out[slot.role].append(slot.info())
        return out

    def scale_role(self, role: str, count: int) -> None:
        """Grow or shrink `role` to `count` nodes while the job runs (highest ranks go first)."""
        if role not in self.spec.roles:
            raise JobSpecError(f"scale_role: no role '{role}' in job '{self.spec.name}'")
        if count < 0:
            raise JobSpecError(f"scale_role: role '{role}': count must be >= 0, got {count}")
        active = sorted((s for s in self.slots.values() if s.role == role and s.state != NodeState.STOPPED),
                        key=lambda s: s.rank)  # fmt: skip
        if count < len(active):
            self._stop_nodes(active[count:], f"role '{role}' scaled down to {count}")
        elif count > len(active):
            bundles = Placement.allocate(self.spec, roles={role: count})  # refuses what does not fit
            new = [m for b in bundles for m in b.members if m.role == role and m.rank >= len(active)]
            for member in new:
                slot = self.slots.get(node_id(member.role, member.rank))
                if slot is None:
                    self._register(member)
                else:
                    slot.reset_for_restart(count=False)
                    self._to_pending(slot, f"role '{role}' scaled up to {count}")
            self._launch([Bundle(-1, 0.0, 0.0, 0, (), tuple(new))])
        self.store.record_decision(self.job_id, "SCALE", role, f"role '{role}' scaled to {count}")
        self.log(f"role '{role}' scaled from {len(active)} to {count}")

    # ---- master failover ----------------------------------------------------------------------
    def reattach(self) -> None:
        """Rebuild the node registry from the store after a master restart; lost nodes get restarted."""
        now = time.monotonic()
        half_done: list[NodeSlot] = []
        previous = self.store.job(self.job_id).master_pid
        records = self.store.nodes(self.job_id)
        live = sum(record.state in LIVE_NODE_STATES for record in records)
        # The event log (dashboard, `rlplex status`) shows a failover as one decision of its own, not
        # only as the job's RUNNING -> READY below (which a resume of a READY job has not).
        self.store.record_decision(
            self.job_id, "FAILOVER", "master",
            f"master pid {os.getpid()} took over from pid {previous}; {live} of {len(records)} nodes to reattach",
        )  # fmt: skip
        for record in records:
            slot = NodeSlot.from_record(self.store, record, self.spec.roles[record.role].kind)
            self.slots[slot.node_id] = slot
            if slot.state in (NodeState.PENDING, NodeState.FAILED):
                half_done.append(slot)
            if slot.state not in LIVE_NODE_STATES:
                continue
            slot.handle = self.scheduler.attach(
                slot.node_id, slot.role, slot.rank, slot.incarnation, record.pid, record.create_time
            )
            slot.last_heartbeat = slot.progress_changed = now
            if self.scheduler.is_alive(slot.handle) and record.address:
                try:
                    slot.client = self.scheduler.client(slot.handle, record.address)
                    reported = str(slot.client.call("status", timeout_s=2.0))
                    # A node that ended with no master is still delivering its final message (last
                    # progress, error): its verdict comes from there, else the job may stop first.
                    if reported not in (NodeState.FINISHED, NodeState.FAILED):
                        slot.reported = reported
                    slot.address = record.address
                except RlplexError as error:
                    self.log(f"re-attach to {slot.node_id} failed: {error}")
        if self.job.state == JobState.INIT:
            self.fail("the master died during prepare(); run the job again")
            return
        if self.job.state == JobState.RUNNING:
            self._job_to(JobState.READY, "master failover: the master restarted")
        self._failover = True
        for slot in half_done:
            # PENDING: a restart (or scale-up) decided, its launch not recorded; the previous master may
            # have launched a process for that incarnation, so this one gets the next (the other is stale).
            # FAILED: a failure recorded, the restart not decided; its budget was spent with the decision.
            verb = "redone" if slot.state == NodeState.PENDING else "completed"
            slot.reset_for_restart(count=slot.state == NodeState.FAILED)
            self._to_pending(slot, f"master failover: a restart the previous master left half-done is {verb}")
            self._relaunch(slot)
        self.log(f"re-attached: {self.summary()}")

    def summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for slot in self.slots.values():
            counts[slot.state.value] = counts.get(slot.state.value, 0) + 1
        return {"job": self.job.state.value, "nodes": counts}
