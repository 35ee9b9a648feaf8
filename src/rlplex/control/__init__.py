"""rlplex.control: the control plane (seed 003, DLRover hybrid training).

A `PrimeMaster` places, starts, watches and heals the processes of a job declared as a
`JobSpec` of roles. Names are loaded lazily so that a node process (`python -m
rlplex.control.node`) imports only what it needs and starts fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlplex.control.backends.local import LocalScheduler
    from rlplex.control.backends.ray import RayScheduler
    from rlplex.control.backends.ray_master import RayMasterHandle
    from rlplex.control.backends.scheduler import NodeClient, NodeEvent, NodeHandle, Scheduler
    from rlplex.control.channels.base import ChannelClosedError, ChannelError, ChannelTimeoutError, DataChannel
    from rlplex.control.channels.local import LocalDataChannel
    from rlplex.control.channels.ray import RayDataChannel
    from rlplex.control.channels.selfloop import SelfLoopStats, run_self_loop
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


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'rlplex.control' has no attribute '{name}'")
    return getattr(importlib.import_module(f"rlplex.control.{module}"), name)
