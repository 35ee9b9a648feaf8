"""The Ray backend: every node is a detached, named Ray actor in a placement group.

`create_nodes(bundles)` makes one placement group for the bundles it is given (one Ray bundle
per `Placement` bundle: the sum of its members' cpu, gpu, memory and custom resources) and one
actor per member, `rlplex-<job_id>-<node_id>` in the "rlplex" namespace, scheduled into its
bundle. The actor hosts the same `NodeRuntime` as a node process: heartbeats and the control
RPC use the same authenticated sockets, so the manager cannot tell the backends apart.

Liveness is Ray's: each actor answers `wait_exit()` when its runtime ends, with the exit code;
an actor that dies (SIGKILL, node loss) fails that call. Actors and placement groups are
detached so that a master actor restarted by Ray (master failover) finds the nodes still
running; `cleanup()` removes every actor and placement group of the job by name.

Multi-machine clusters: the job's output folder (SQLite store, logs, token) must be on a
filesystem every Ray node sees at the same path, and the master and nodes then bind their
sockets to the machine's IP (reported by Ray) instead of 127.0.0.1; peers still authenticate
with the job token, which each node reads from the job folder (never an actor argument). Variables
named RLPLEX_* in the master's environment (except the token) are set in every node.
"""

from __future__ import annotations

import math
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import ray
from ray import PlacementGroupID
from ray.exceptions import RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlplex.control.backends.ray_node import RemoteNode
from rlplex.control.backends.scheduler import NodeHandle
from rlplex.control.backends.served import ServedScheduler
from rlplex.control.job.placement import Bundle, Member
from rlplex.control.job.spec import JobSpec, Resources
from rlplex.errors import PlacementError

NAMESPACE = "rlplex"
ENV_PREFIX = "RLPLEX_"
_KILL_WAIT_S = 5.0


def child_pythonpath() -> str:
    """rlplex's own source first (a worktree must beat an installed copy), then this process's sys.path."""
    import rlplex

    entries = [str(Path(rlplex.__file__).resolve().parents[1]), *(p for p in sys.path if p)]
    return os.pathsep.join(dict.fromkeys(entries))


# Ray starts its workers at nice 15 (raylet's worker_niceness): on a machine with anything else to
# run, a job's trainer ranks and agents then get a sliver of the cores, miss their heartbeat
# deadlines, and a 2-minute node check never ends. A Ray that rlplex starts runs them as the driver.
LOCAL_RAY_SYSTEM_CONFIG: dict[str, Any] = {"worker_niceness": 0}


def connect_ray(address: str | None, capacity: Resources) -> bool:
    """Join `address`, or start a local Ray sized by the job's capacity; True when Ray runs on this machine only."""
    if not ray.is_initialized():
        options: dict[str, Any] = {"include_dashboard": False, "namespace": NAMESPACE, "log_to_driver": False}
        options["runtime_env"] = {"env_vars": {"PYTHONPATH": child_pythonpath()}}
        if address is None:
            options["num_cpus"] = max(1, math.ceil(capacity.cpu))
            options["num_gpus"] = math.ceil(capacity.gpu)
            options["_system_config"] = LOCAL_RAY_SYSTEM_CONFIG
        # No address: a Ray of the job's own. Ray's own default (None) joins the newest `ray start`
        # cluster on this machine, which refuses the sizes above with a long traceback; joining
        # an existing cluster is what --ray-address (auto, or its address) asks for.
        ray.init(address=address or "local", **options)
    return len([n for n in ray.nodes() if n.get("Alive")]) <= 1 and address is None


def forwarded_env() -> dict[str, str]:
    # Where the job runs is settled by the driver already; a node must not re-decide it. The token
    # is never forwarded: a node reads it from the job folder (see rlplex.control.job.token).
    settled = ("RLPLEX_BACKEND", "RLPLEX_RAY_ADDRESS", "RLPLEX_JOB_TOKEN")
    return {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX) and k not in settled}


def ray_resources(cpu: float, gpu: float, memory_mb: int, custom: dict[str, float]) -> dict[str, float]:
    out = {"CPU": cpu, "GPU": gpu, "memory": float(memory_mb) * 2**20, **custom}
    out = {k: v for k, v in out.items() if v > 0}
    # Ray refuses an empty bundle; a role that asks for nothing still gets a sliver of a CPU.
    return out or {"CPU": 0.001}


@dataclass
class ActorRef:
    """What `NodeHandle.ref` holds on Ray: the actor, the pending `wait_exit()`, and its bundle's group."""

    actor: Any
    exit_ref: Any
    pg: PlacementGroup | None = None
    code: int | None = None
    dead: bool = False


class RayScheduler(ServedScheduler):
    def __init__(
        self, spec: JobSpec, job_id: str, token: bytes, rpc_timeout_s: float = 10.0, connect: bool = True
    ) -> None:
        self.spec = spec
        local = connect_ray(spec.ray_address, spec.capacity) if connect else True
        self.host = "127.0.0.1" if local else ray.util.get_node_ip_address()
        super().__init__(spec.output_dir, job_id, token, rpc_timeout_s, self.host)
        self._group_table: dict[str, Any] | None = None
        self._env = forwarded_env()

    # ---- names ------------------------------------------------------------------------------
    def actor_name(self, node_id: str) -> str:
        return f"rlplex-{self.job_id}-{node_id}"

    def _pg_prefix(self) -> str:
        return f"rlplex-{self.job_id}-pg-"

    def _pg_name(self, owners: list[str]) -> str:
        # The owners' node ids in the name let a resumed master find a lost node's bundle again.
        return f"{self._pg_prefix()}{'+'.join(owners)}-{uuid.uuid4().hex[:8]}"

    def _find_group(self, node_id: str) -> PlacementGroup | None:
        """The placement group a previous master made for `node_id`'s bundle, if Ray still holds it."""
        if self._group_table is None:
            self._group_table = ray.util.placement_group_table()
        prefix = self._pg_prefix()
        for pg_id, info in self._group_table.items():
            name = str(info.get("name", ""))
            if name.startswith(prefix) and info.get("state") == "CREATED":
                owners = name[len(prefix) :].rsplit("-", 1)[0].split("+")
                if node_id in owners:
                    return PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id)))
        return None

    # ---- placement --------------------------------------------------------------------------
    def _member_resources(self, member: Member) -> dict[str, float]:
        r = self.spec.roles[member.role].resources
        return ray_resources(r.cpu, r.gpu, r.memory_mb, r.custom)

    def _placement_groups(self, shapes: list[dict[str, float]], owners: list[list[str]]) -> list[PlacementGroup]:
        """One placement group per bundle, so that a bundle's resources go back when its nodes stop for good."""
        groups = [
            placement_group([shape], name=self._pg_name(who), lifetime="detached")
            for shape, who in zip(shapes, owners, strict=True)
        ]
        ready = [pg.ready() for pg in groups]
        placed, _ = ray.wait(ready, num_returns=len(ready), timeout=self.spec.start_timeout_s)
        if len(placed) < len(ready):
            missing = [shape for shape, ref in zip(shapes, ready, strict=True) if ref not in placed]
            for pg in groups:
                remove_placement_group(pg)
            raise PlacementError(
                f"job '{self.spec.name}': Ray could not place bundles {missing} within {self.spec.start_timeout_s:g} s "
                f"(cluster resources: {ray.cluster_resources()})"
            )
        return groups

    def create_nodes(self, bundles: list[Bundle], incarnations: dict[str, int]) -> list[NodeHandle]:
        # Ad-hoc bundles (index -1: scale-up, a node without a bundle) carry no resources: one
        # bundle per member, sized by its role.
        shapes: list[dict[str, float]] = []
        owners: list[list[str]] = []
        where: list[tuple[Member, int]] = []
        for bundle in bundles:
            if bundle.index < 0:
                for member in bundle.members:
                    where.append((member, len(shapes)))
                    shapes.append(self._member_resources(member))
                    owners.append([member.node_id])
                continue
            for member in bundle.members:
                where.append((member, len(shapes)))
            shapes.append(ray_resources(bundle.cpu, bundle.gpu, bundle.memory_mb, dict(bundle.custom)))
            owners.append([m.node_id for m in bundle.members])
        if not shapes:
            return []
        groups = self._placement_groups(shapes, owners)
        return [self._launch(m.node_id, m.role, m.rank, incarnations.get(m.node_id, 0), groups[i]) for m, i in where]

    def _launch(self, node_id: str, role: str, rank: int, incarnation: int, pg: PlacementGroup | None) -> NodeHandle:
        if pg is None:  # a re-attached node restarts into a placement group of its own
            pg = self._placement_groups([self._member_resources(Member(role, rank))], [[node_id]])[0]
        r = self.spec.roles[role].resources
        options: dict[str, Any] = {
            "name": self.actor_name(node_id),
            "namespace": NAMESPACE,
            "lifetime": "detached",
            "max_restarts": 0,  # restarts are the failure policy's decision, with a new incarnation
            "max_concurrency": 16,  # wait_exit() blocks a thread; a resumed master asks again
            "num_cpus": r.cpu,
            "num_gpus": r.gpu,
            "resources": dict(r.custom),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
        }
        if r.memory_mb:
            options["memory"] = r.memory_mb * 2**20
        host = self.host
        for attempt in range(50):
            try:
                actor = RemoteNode.options(**options).remote(
                    str(self.output_dir), self.job_id, node_id, incarnation, host, self._env
                )
                break
            except ValueError:  # the name of the killed incarnation is not released yet
                if attempt == 49:
                    raise
                time.sleep(0.05)
        handle = NodeHandle(node_id, role, rank, incarnation, ref=ActorRef(actor, actor.wait_exit.remote(), pg))
        self._handles[node_id] = handle
        return handle

    # ---- the Scheduler protocol -------------------------------------------------------------
    def restart(self, handle: NodeHandle, incarnation: int) -> NodeHandle:
        self._end(handle)  # the placement group stays: the new incarnation goes into the same bundle
        ref = handle.ref if isinstance(handle.ref, ActorRef) else None
        return self._launch(handle.node_id, handle.role, handle.rank, incarnation, ref.pg if ref else None)

    def attach(self, node_id: str, role: str, rank: int, incarnation: int, pid: int, create_time: float) -> NodeHandle:
        handle = NodeHandle(node_id, role, rank, incarnation, pid, create_time)
        pg = self._find_group(node_id)
        try:
            actor = ray.get_actor(self.actor_name(node_id), namespace=NAMESPACE)
            handle.ref = ActorRef(actor, actor.wait_exit.remote(), pg)
        except ValueError:
            handle.ref = ActorRef(None, None, pg, dead=True)  # no such actor: the node is lost
        self._handles[node_id] = handle
        return handle

    def _settle(self, ref: ActorRef, timeout: float) -> bool:
        """True once the actor's runtime has ended; records its exit code (None when the actor died)."""
        if ref.dead:
            return True
        ready, _ = ray.wait([ref.exit_ref], timeout=timeout)
        if not ready:
            return False
        try:
            ref.code = int(ray.get(ref.exit_ref))
        except RayError:
            ref.code = None
        ref.dead = True
        try:
            ray.kill(ref.actor, no_restart=True)  # a finished node gives its resources back now
        except RayError:
            pass
        return True

    def is_alive(self, handle: NodeHandle) -> bool:
        ref = handle.ref
        return isinstance(ref, ActorRef) and not self._settle(ref, 0)

    def exit_code(self, handle: NodeHandle) -> int | None:
        return handle.ref.code if isinstance(handle.ref, ActorRef) else None

    def kill(self, handle: NodeHandle) -> None:
        """Kill the node for good: its bundle's placement group goes too once no live node shares it."""
        self._end(handle)
        ref = handle.ref
        if not isinstance(ref, ActorRef) or ref.pg is None:
            return
        for other in self._handles.values():
            if (
                other is not handle
                and isinstance(other.ref, ActorRef)
                and other.ref.pg is ref.pg
                and not other.ref.dead
            ):
                return
        try:
            remove_placement_group(ref.pg)
        except RayError:
            pass
        ref.pg = None

    def _end(self, handle: NodeHandle) -> None:
        ref = handle.ref
        if not isinstance(ref, ActorRef) or ref.dead:
            return
        try:
            ray.kill(ref.actor, no_restart=True)
        except RayError:
            pass
        if self.host == "127.0.0.1" and handle.pid > 0:
            # Ray gives a hung (e.g. SIGSTOPped) actor 5 s of grace before its SIGKILL, and keeps
            # the bundle's resources meanwhile; on one machine we can end it at once.
            _kill_ray_worker(handle.pid)
        # Wait for Ray to see the death: the actor's name is free again after it.
        self._settle(ref, _KILL_WAIT_S)

    def cleanup(self) -> None:
        for handle in self._handles.values():
            self.kill(handle)
        self._handles.clear()
        prefix = f"rlplex-{self.job_id}-"
        self._group_table = None
        # Also what a previous master of this job created (after a master failover).
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry.get("namespace") == NAMESPACE and str(entry.get("name", "")).startswith(prefix):
                try:
                    ray.kill(ray.get_actor(entry["name"], namespace=NAMESPACE), no_restart=True)
                except (ValueError, RayError):
                    pass
        for pg_id, info in ray.util.placement_group_table().items():
            if str(info.get("name", "")).startswith(prefix) and info.get("state") != "REMOVED":
                try:
                    remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
                except (RayError, ValueError):
                    pass
        self._server.close()

    def detach(self) -> None:
        """Forget the nodes without killing them (tests simulate a master that dies)."""
        self._handles.clear()
        self._server.close()


def _kill_ray_worker(pid: int) -> None:
    try:
        process = psutil.Process(pid)
        if any("ray" in part for part in process.cmdline()):  # never a stranger that reused the pid
            process.kill()
    except psutil.Error:
        pass
