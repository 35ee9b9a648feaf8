"""The elastic rendezvous as data: its state machine, the role configs, and the messages between
an `ElasticWorker` and its `ElasticMaster`.

Rendezvous states (one machine per ElasticMaster, recorded in the job store as entity
'<master node>:rendezvous' and in `<output_dir>/elastic/<master node>.json`):

    INIT -> WAITING      gathering live members (all expected ones, or >= min_nodes after join_timeout_s)
    WAITING -> CHECKING  node check of members not checked yet (gloo all-reduce + matmul timing)
    CHECKING -> READY    every checked member passed (slow ones are reported, not refused)
    WAITING -> READY     nothing new to check
    READY -> RUNNING     the scripts run with the new world (ranks, port, restart count)
    RUNNING -> RESTARTING  a member was lost, a script failed, or a new member joined
    RESTARTING -> WAITING  every surviving script is stopped
    RUNNING -> FINISHED  every script exited 0
    any live state -> FAILED  (budget spent, too few nodes, a failing check during prepare)

Workers pull: every `sync_interval_s` a worker sends a `report` (its script's and check's state,
progress, and an endpoint: its node's address and a port it holds free, see `PortReservation`)
and gets back its `assignment` (epoch, action idle/check/run/finish, rank, world, addr, port; an
idle that ends a round a rank was lost from says `abort`: stop with `abort_grace_s`). A round's
MASTER_ADDR:MASTER_PORT is the endpoint its rank 0 reported, so the rendezvous store runs on rank
0's machine whichever machine the ElasticMaster is on. The worker reconciles towards the
assignment, so a lost message or a restarted master costs nothing but one interval.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from rlplex.config import StrictModel, format_validation_error
from rlplex.errors import JobSpecError, RlplexError


class RendezvousError(RlplexError):
    """The rendezvous cannot go on: too few nodes, a failing node check, restart budget spent."""


class RendezvousState(StrEnum):
    INIT = "INIT"
    WAITING = "WAITING"
    CHECKING = "CHECKING"
    READY = "READY"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"


R = RendezvousState
RDZV_TRANSITIONS: dict[RendezvousState, frozenset[RendezvousState]] = {
    R.INIT: frozenset({R.WAITING, R.FAILED}),
    R.WAITING: frozenset({R.CHECKING, R.READY, R.FAILED}),
    R.CHECKING: frozenset({R.READY, R.WAITING, R.FAILED}),
    R.READY: frozenset({R.RUNNING, R.FAILED}),
    R.RUNNING: frozenset({R.RESTARTING, R.FINISHED, R.FAILED}),
    R.RESTARTING: frozenset({R.WAITING, R.FAILED}),
    R.FINISHED: frozenset(),
    R.FAILED: frozenset(),
}

# Actions of an assignment.
IDLE, CHECK, RUN, FINISH = "idle", "check", "run", "finish"


class ElasticConfig(StrictModel):
    """`[roles.<elastic master>.config]`."""

    workers: str = Field(min_length=1, description="the role of the ElasticWorkers this master manages")
    min_nodes: int | None = Field(default=None, ge=1, description="fewest members to train with (default: count)")
    max_nodes: int | None = Field(default=None, ge=1, description="most members to train with (default: count)")
    node_check: bool = True
    dist_backend: Literal["gloo", "nccl"] = Field(default="gloo", description="the node check's backend")
    check_timeout_s: float = Field(default=60.0, gt=0)
    matmul_size: int = Field(default=256, ge=8)
    slow_factor: float = Field(default=2.0, gt=1.0, description="a matmul this many times the median is slow")
    join_timeout_s: float = Field(default=10.0, ge=0, description="wait this long for missing members")
    rendezvous_timeout_s: float = Field(default=60.0, gt=0, description="fail with fewer than min_nodes after this")
    member_timeout_s: float = Field(
        default=10.0, gt=0, description="a member whose agent is silent this long is lost (a dead node is seen at once)"
    )
    stop_timeout_s: float = Field(default=10.0, gt=0)
    max_restarts: int = Field(default=3, ge=0, description="re-rendezvous budget (failures and master take-overs)")
    poll_interval_s: float = Field(default=0.05, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> ElasticConfig:
        if self.min_nodes is not None and self.max_nodes is not None and self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) > max_nodes ({self.max_nodes})")
        return self


class ScriptConfig(StrictModel):
    """`[roles.<elastic workers>.config]`: the user's training script, run as under torchrun."""

    script: str | None = Field(default=None, description="path of a Python file")
    module: str | None = Field(default=None, description="a module run with python -m")
    entrypoint: str | None = Field(
        default=None,
        pattern=r"^[\w.]+:[\w.]+$",
        description="'module:function' taking one pydantic config model, run by rlplex.control.elastic.entry",
    )
    config: dict[str, Any] = Field(
        default_factory=dict, description="the entrypoint's config: its model's JSON, rebuilt as the model"
    )
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    checkpoint_dir: str | None = Field(default=None, description="default: <output_dir>/elastic/checkpoints/<job id>")
    sync_interval_s: float = Field(default=0.1, gt=0)
    stop_grace_s: float = Field(default=1.0, ge=0, description="SIGTERM to SIGKILL when stopping a script")
    abort_grace_s: float = Field(
        default=1.0,
        ge=0,
        description="SIGTERM to SIGKILL for the survivors of a round that a lost or failed rank ended: their "
        "collectives and store waits on that rank cannot complete, so a longer grace only delays the re-rendezvous",
    )
    omp_num_threads: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _one_target(self) -> ScriptConfig:
        if [self.script, self.module, self.entrypoint].count(None) != 2:
            raise ValueError("give exactly one of 'script' (a file), 'module' or 'entrypoint' (a function)")
        if self.entrypoint is not None and self.args:
            raise ValueError("'args' are for a script or module; an entrypoint takes 'config'")
        if self.entrypoint is None and self.config:
            raise ValueError("'config' is for an entrypoint; a script or module takes 'args'")
        return self


def parse_role_config(model: type[StrictModel], data: dict[str, Any], role: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise JobSpecError(format_validation_error(f"role '{role}': field 'config'", error)) from None


LOCAL_HOST = "127.0.0.1"


def serve_tcp_store(sock: socket.socket, timeout_s: float) -> Any:
    """torch's TCPStore server on `sock` (bound, not yet listening), which it then owns and closes.

    `TCPStore(host, port, is_master=True)` listens on every interface, IPv4 and IPv6, whatever
    `host` says, and the store authenticates nobody; given a listening socket it serves that one,
    so the store is reachable on the address the socket is bound to only (127.0.0.1 on one
    machine). Torch is imported here, by the one process that serves a store."""
    from datetime import timedelta

    import torch.distributed as dist

    host, port = sock.getsockname()[:2]
    sock.listen(128)
    fd = sock.detach()
    try:
        return dist.TCPStore(
            host, port, None, True, timedelta(seconds=timeout_s), wait_for_workers=False, master_listen_fd=fd
        )
    except BaseException:
        os.close(fd)
        raise


class PortReservation:
    """A port held for a round's rendezvous store from the moment a node reports it until the
    round ends; rank 0's node serves the store on it (`serve_store`).

    A port that was merely free when reported (bind, close) can be taken meanwhile by any connect()
    on the machine, and the store then cannot listen: an extra re-rendezvous. The socket here
    stays bound and never listens until the round's store serves it.
    """

    def __init__(self, host: str = LOCAL_HOST) -> None:
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self.port = int(self._sock.getsockname()[1])
        self._store: Any = None

    def serve_store(self, timeout_s: float = 300.0) -> None:
        """Serve the round's torch.distributed store here; the ranks join it as clients, as under
        torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True in their environment)."""
        if self._store is None:
            self._store = serve_tcp_store(self._sock, timeout_s)

    def release(self) -> None:
        self._store = None  # the store's server stops and closes the socket it owns
        self._sock.close()


def rendezvous_endpoint(rank0: str, report: dict[str, Any]) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT of a round: the endpoint reported by `rank0`'s node (see `ElasticWorker`)."""
    endpoint = report.get("endpoint")
    host = endpoint.get("host") if isinstance(endpoint, dict) else None
    port = endpoint.get("port") if isinstance(endpoint, dict) else None
    if not isinstance(host, str) or not host or not isinstance(port, int) or not 0 < port < 65536:
        raise RendezvousError(f"member {rank0} (rank 0) reported no usable endpoint: {endpoint!r}")
    return host, port


def local_layout(hosts: list[str]) -> list[dict[str, int]]:
    """Per rank (the list is in rank order, one host per rank): its rank among the ranks on the same
    machine (LOCAL_RANK, the GPU it takes), how many ranks that machine runs (LOCAL_WORLD_SIZE) and
    the machine's index in order of first appearance (GROUP_RANK)."""
    groups: dict[str, int] = {}
    counts: dict[str, int] = {}
    out = []
    for host in hosts:
        groups.setdefault(host, len(groups))
        out.append({"local_rank": counts.get(host, 0), "group_rank": groups[host]})
        counts[host] = counts.get(host, 0) + 1
    for entry, host in zip(out, hosts, strict=True):
        entry["local_world"] = counts[host]
    return out


def dist_env(assignment: dict[str, Any]) -> dict[str, str]:
    """torchrun's environment of one rank for a check or a run assignment.

    The ranks join the round's store as clients: rank 0's node serves it (`PortReservation`), as
    torchrun's agent does. On one machine gloo and NCCL are kept on the loopback interface too
    (their own listening sockets); a user's GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME still wins."""
    env = {
        "RANK": str(assignment["rank"]),
        "LOCAL_RANK": str(assignment["local_rank"]),
        "WORLD_SIZE": str(assignment["world"]),
        "LOCAL_WORLD_SIZE": str(assignment["local_world"]),
        "GROUP_RANK": str(assignment["group_rank"]),
        "MASTER_ADDR": str(assignment["addr"]),
        "MASTER_PORT": str(assignment["port"]),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    if str(assignment["addr"]) in (LOCAL_HOST, "::1", "localhost"):
        env.update(loopback_collectives_env())
    return env


def loopback_collectives_env() -> dict[str, str]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME = lo where unset: gloo's and NCCL's own listening
    sockets go on the interface the host name resolves to (often the machine's IP) otherwise.
    For ranks that all run on this machine (Linux's loopback is named "lo")."""
    if sys.platform != "linux":
        return {}
    return {name: "lo" for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if name not in os.environ}


def slow_nodes(results: dict[str, dict[str, Any]], factor: float) -> dict[str, str]:
    """Members whose matmul took over `factor` times the median (needs >= 2 results)."""
    times = {n: float(r["matmul_s"]) for n, r in results.items() if r.get("ok") and r.get("matmul_s")}
    if len(times) < 2:
        return {}
    median = statistics.median(times.values())
    return {
        n: f"matmul {t * 1e3:.1f} ms, {t / median:.1f}x the median {median * 1e3:.1f} ms"
        for n, t in times.items()
        if t > factor * median
    }


def failed_checks(results: dict[str, dict[str, Any]]) -> dict[str, str]:
    return {n: str(r.get("error") or "node check failed") for n, r in results.items() if not r.get("ok")}


@dataclass
class Member:
    node_id: str
    rank: int  # the node's rank in its role (members are ordered by it)
    incarnation: int
    last_sync: float
    report: dict[str, Any] = field(default_factory=dict)
    syncs: int = 0
    checked: bool = False
    excluded: str | None = None


@dataclass(frozen=True)
class RoundEnd:
    """Why a running round must restart; `rank_lost`: one of its ranks died or went silent."""

    cause: str
    rank_lost: bool
