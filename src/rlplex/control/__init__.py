"""rlplex.control: the control plane (seed 003, DLRover hybrid training).

A `PrimeMaster` places, starts, watches and heals the processes of a job declared as a
`JobSpec` of roles. Names are loaded lazily so that a node process (`python -m
rlplex.control.node`) imports only what it needs and starts fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlplex.control.channel import ChannelClosedError, ChannelError, ChannelTimeoutError, DataChannel
    from rlplex.control.channel_local import LocalDataChannel
    from rlplex.control.channel_ray import RayDataChannel
    from rlplex.control.elastic import ElasticMaster, ElasticWorker
    from rlplex.control.elastic_rdzv import RendezvousError, RendezvousState
    from rlplex.control.health import (
        Action,
        Decision,
        DefaultFailurePolicy,
        FailurePolicy,
        JobStatus,
        NodeStatus,
        RoleStatus,
        detect_failure,
    )
    from rlplex.control.local_scheduler import LocalScheduler
    from rlplex.control.manager import PrimeManager
    from rlplex.control.master import PrimeMaster
    from rlplex.control.placement import Bundle, Member, Placement
    from rlplex.control.ray_master import RayMasterHandle
    from rlplex.control.ray_scheduler import RayScheduler
    from rlplex.control.role_group import RoleGroup
    from rlplex.control.scheduler import NodeClient, NodeEvent, NodeHandle, Scheduler
    from rlplex.control.selfloop import SelfLoopStats, run_self_loop
    from rlplex.control.slot import NodeInfo
    from rlplex.control.spec import JobBuilder, JobSpec, Resources, RestartPolicy, RoleSpec, load_job, parse_job
    from rlplex.control.states import JobState, NodeState, StateMachine
    from rlplex.control.store import JobStore, SqliteStateStore, StateStore
    from rlplex.control.worker import FunctionWorker, SubMaster, Worker, WorkerContext, WorkerLoad

_WHERE = {
    "ChannelClosedError": "channel",
    "ChannelError": "channel",
    "ChannelTimeoutError": "channel",
    "DataChannel": "channel",
    "LocalDataChannel": "channel_local",
    "RayDataChannel": "channel_ray",
    "ElasticMaster": "elastic",
    "ElasticWorker": "elastic",
    "RendezvousError": "elastic_rdzv",
    "RendezvousState": "elastic_rdzv",
    "SelfLoopStats": "selfloop",
    "run_self_loop": "selfloop",
    "Action": "health",
    "Decision": "health",
    "DefaultFailurePolicy": "health",
    "FailurePolicy": "health",
    "JobStatus": "health",
    "NodeStatus": "health",
    "RoleStatus": "health",
    "detect_failure": "health",
    "LocalScheduler": "local_scheduler",
    "PrimeManager": "manager",
    "PrimeMaster": "master",
    "Bundle": "placement",
    "Member": "placement",
    "Placement": "placement",
    "RayMasterHandle": "ray_master",
    "RayScheduler": "ray_scheduler",
    "RoleGroup": "role_group",
    "NodeClient": "scheduler",
    "NodeEvent": "scheduler",
    "NodeHandle": "scheduler",
    "Scheduler": "scheduler",
    "NodeInfo": "slot",
    "JobBuilder": "spec",
    "JobSpec": "spec",
    "Resources": "spec",
    "RestartPolicy": "spec",
    "RoleSpec": "spec",
    "load_job": "spec",
    "parse_job": "spec",
    "JobState": "states",
    "NodeState": "states",
    "StateMachine": "states",
    "JobStore": "store",
    "SqliteStateStore": "store",
    "StateStore": "store",
    "FunctionWorker": "worker",
    "SubMaster": "worker",
    "Worker": "worker",
    "WorkerContext": "worker",
    "WorkerLoad": "worker",
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
