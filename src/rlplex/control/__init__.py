"""rlplex.control: the control plane (seed 003, DLRover hybrid training).

A `PrimeMaster` places, starts, watches and heals the processes of a job declared as a
`JobSpec` of roles. Names are loaded lazily so that a node process (`python -m
rlplex.control.node.runtime`) imports only what it needs and starts fast.

Folders: `job/` (the spec, state machines, SQLite store, placement, health, master and its
control loop), `node/` (a node's runtime and hooks, the master's view of it), `backends/` (where
nodes run: local processes or Ray actors), `elastic/` (torchrun-style training under a
sub-master), `channels/` (`DataChannel` and the self-loop); `rpc.py` is the one RPC they share.

Glossary: the views of "a node", one process of a role (`node_id` = `<role>-<rank>`):

- `RoleSpec` (job/spec): what the user declares; a role's `count` nodes are made from it.
- `NodeState` (job/states): a node's life, PENDING -> CREATED -> CHECKED -> RUNNING ->
  FINISHED / FAILED / STOPPED; the one vocabulary for a node's state, whether the master
  records it, the node reports it or a view shows it.
- `NodeRecord` (job/store): a node's row in `job.sqlite` (state, incarnation, address), what
  every reader beside the master sees, through `JobStore`.
- `NodeSlot` (node/slot): the master's live view: its state machine, backend handle, RPC
  client, the state the node last `reported` and its last heartbeat.
- `NodeInfo` (node/slot): a node as the registry lists it (`get_nodes_by_role`).
- `NodeStatus` (job/health): a frozen snapshot of a slot that the failure policy decides on.
- `NodeHandle` / `NodeEvent` / `NodeClient` (backends/scheduler): a node as a backend knows
  it (a Popen or an actor), what it says over the heartbeat connection, the RPC to it.
- `NodeRuntime` (node/runtime): the node process itself, hosting one `Worker`;
  `NodeActor` (backends/ray_node) hosts it inside a Ray actor.
- `Worker` / `WorkerContext` (node/worker): the user's code in the node, and what it knows of
  its job; its `state` is the `NodeState` it reports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlplex.lazy import lazy_getattr

if TYPE_CHECKING:
    from rlplex.control.backends.local import LocalScheduler
    from rlplex.control.backends.ray import RayScheduler
    from rlplex.control.backends.ray_master import RayMasterHandle
    from rlplex.control.backends.scheduler import NodeClient, NodeEvent, NodeHandle, Scheduler
    from rlplex.control.channels.base import ChannelClosedError, ChannelError, ChannelTimeoutError, DataChannel
    from rlplex.control.channels.local import LocalDataChannel
    from rlplex.control.channels.ray import RayDataChannel
    from rlplex.control.channels.selfloop import SelfLoopStats, run_self_loop
    from rlplex.control.channels.stage import SelfLoopWorker
    from rlplex.control.elastic.master import ElasticMaster, ElasticWorker
    from rlplex.control.elastic.rdzv import RendezvousError, RendezvousState
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
    from rlplex.control.job.manager import PrimeManager
    from rlplex.control.job.master import PrimeMaster
    from rlplex.control.job.placement import Bundle, Member, Placement
    from rlplex.control.job.spec import JobBuilder, JobSpec, Resources, RestartPolicy, RoleSpec, load_job, parse_job
    from rlplex.control.job.states import JobState, NodeState, StateMachine
    from rlplex.control.job.store import JobStore, SqliteStateStore, StateStore
    from rlplex.control.node.role_group import RoleGroup
    from rlplex.control.node.slot import NodeInfo
    from rlplex.control.node.worker import FunctionWorker, SubMaster, Worker, WorkerContext, WorkerLoad

_WHERE = {
    "ChannelClosedError": "channels.base",
    "ChannelError": "channels.base",
    "ChannelTimeoutError": "channels.base",
    "DataChannel": "channels.base",
    "LocalDataChannel": "channels.local",
    "RayDataChannel": "channels.ray",
    "ElasticMaster": "elastic.master",
    "ElasticWorker": "elastic.master",
    "RendezvousError": "elastic.rdzv",
    "RendezvousState": "elastic.rdzv",
    "SelfLoopStats": "channels.selfloop",
    "SelfLoopWorker": "channels.stage",
    "run_self_loop": "channels.selfloop",
    "Action": "job.health",
    "Decision": "job.health",
    "DefaultFailurePolicy": "job.health",
    "FailurePolicy": "job.health",
    "JobStatus": "job.health",
    "NodeStatus": "job.health",
    "RoleStatus": "job.health",
    "detect_failure": "job.health",
    "LocalScheduler": "backends.local",
    "PrimeManager": "job.manager",
    "PrimeMaster": "job.master",
    "Bundle": "job.placement",
    "Member": "job.placement",
    "Placement": "job.placement",
    "RayMasterHandle": "backends.ray_master",
    "RayScheduler": "backends.ray",
    "RoleGroup": "node.role_group",
    "NodeClient": "backends.scheduler",
    "NodeEvent": "backends.scheduler",
    "NodeHandle": "backends.scheduler",
    "Scheduler": "backends.scheduler",
    "NodeInfo": "node.slot",
    "JobBuilder": "job.spec",
    "JobSpec": "job.spec",
    "Resources": "job.spec",
    "RestartPolicy": "job.spec",
    "RoleSpec": "job.spec",
    "load_job": "job.spec",
    "parse_job": "job.spec",
    "JobState": "job.states",
    "NodeState": "job.states",
    "StateMachine": "job.states",
    "JobStore": "job.store",
    "SqliteStateStore": "job.store",
    "StateStore": "job.store",
    "FunctionWorker": "node.worker",
    "SubMaster": "node.worker",
    "Worker": "node.worker",
    "WorkerContext": "node.worker",
    "WorkerLoad": "node.worker",
}

__all__ = [
    "Action",
    "Bundle",
    "ChannelClosedError",
    "ChannelError",
    "ChannelTimeoutError",
    "DataChannel",
    "Decision",
    "DefaultFailurePolicy",
    "ElasticMaster",
    "ElasticWorker",
    "FailurePolicy",
    "FunctionWorker",
    "JobBuilder",
    "JobSpec",
    "JobState",
    "JobStatus",
    "JobStore",
    "LocalDataChannel",
    "LocalScheduler",
    "Member",
    "NodeClient",
    "NodeEvent",
    "NodeHandle",
    "NodeInfo",
    "NodeState",
    "NodeStatus",
    "Placement",
    "PrimeManager",
    "PrimeMaster",
    "RayDataChannel",
    "RayMasterHandle",
    "RayScheduler",
    "RendezvousError",
    "RendezvousState",
    "Resources",
    "RestartPolicy",
    "RoleGroup",
    "RoleSpec",
    "RoleStatus",
    "Scheduler",
    "SelfLoopStats",
    "SelfLoopWorker",
    "SqliteStateStore",
    "StateMachine",
    "StateStore",
    "SubMaster",
    "Worker",
    "WorkerContext",
    "WorkerLoad",
    "detect_failure",
    "load_job",
    "parse_job",
    "run_self_loop",
]


__getattr__ = lazy_getattr(__name__, _WHERE)
