"""What a job is, as data: `JobSpec` (roles, restart budget, capacity, timing) and `RoleSpec`.

A job is loaded from TOML (`load_job`) or built in Python (`JobBuilder`). Everything is
validated before any process starts: pydantic checks the fields, then `check_job` imports
every entry point and checks it fits its role's kind and colocation group. Errors name the
role and the field.

    name = "demo"
    output_dir = "outputs/demo"
    [roles.worker]
    kind = "worker"
    count = 4
    entrypoint = "my_pkg.workers:Counter"
    resources = { cpu = 0.5 }
    restart = { scope = "worker", max_restarts = 3 }
    config = { items = 100 }
"""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any, Literal

import psutil
from pydantic import Field, ValidationError

from rlplex.config import StrictModel, format_validation_error, read_toml
from rlplex.errors import JobSpecError
from rlplex.io.safe_files import SAFE_NAME_RULE, is_safe_name

RoleKind = Literal["worker", "submaster", "driver"]
RestartScope = Literal["worker", "role", "job", "never"]


class Resources(StrictModel):
    """What one node of a role needs. Custom resources are named counts (e.g. `{ tpu = 1 }`)."""

    cpu: float = Field(default=1.0, ge=0, description="CPU cores (fractions allowed)")
    gpu: float = Field(default=0.0, ge=0, description="GPUs (fractions allowed)")
    memory_mb: int = Field(default=0, ge=0, description="memory, in MiB")
    custom: dict[str, float] = Field(default_factory=dict, description="named resources and their amounts")


class RestartPolicy(StrictModel):
    """What to restart when a node of this role fails, and how many restarts the role may spend."""

    scope: RestartScope = Field(
        default="worker",
        description="what a failed node restarts: worker (that node), role (every node of its role), job (all "
        "nodes); never: the job fails",
    )
    max_restarts: int = Field(default=3, ge=0, description="restart budget of the role")
    per_node: int = Field(
        default=0,
        ge=0,
        description="restarts each node the role gains while the job runs (scale_role) adds to the role's "
        "budget and the job's: a job that grows keeps the same budget per node",
    )


def _this_machine() -> Resources:
    return Resources(cpu=float(os.cpu_count() or 1), gpu=0.0, memory_mb=psutil.virtual_memory().total // 2**20)


class RoleSpec(StrictModel):
    kind: RoleKind = Field(
        default="worker",
        description="worker, submaster (a SubMaster subclass: a node with children of its own) or driver; nodes "
        "start workers first, drivers last",
    )
    count: int = Field(default=1, ge=0, description="nodes of this role")
    entrypoint: str = Field(pattern=r"^[\w.]+:[\w.]+$", description="'module:attr'")
    resources: Resources = Field(default_factory=Resources, description="what each node of the role needs")
    restart: RestartPolicy = Field(
        default_factory=RestartPolicy, description="what a failure of one of its nodes restarts, and how often"
    )
    colocate: str | None = Field(
        default=None,
        description="a colocation group: rank i of every role in it shares one resource bundle (the sum of "
        "theirs); its roles need equal counts; None: a bundle per node",
    )
    heartbeat_timeout_s: float = Field(
        default=3.0, gt=0, description="a running node without a heartbeat for this long has failed"
    )
    progress_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="a running node whose progress counters stay unchanged this long has failed; None: no check",
    )
    config: dict[str, Any] = Field(
        default_factory=dict, description="the role's settings, checked against its entry point's config_model"
    )
    needs_job_token: bool = Field(
        default=False,
        description="put the job token in the entry point's environment (RLPLEX_JOB_TOKEN), for code that "
        "opens control connections itself; off, neither it nor the processes it starts see the token",
    )


class JobSpec(StrictModel):
    name: str = Field(min_length=1, description=f"the job's name ({SAFE_NAME_RULE})")
    output_dir: Path = Field(
        description="the job's folder: its state (job.sqlite, job.token) and node logs (logs/<node_id>.log)"
    )
    backend: Literal["local", "ray"] = Field(
        default="local", description="local: node processes on this machine; ray: Ray actors"
    )
    ray_address: str | None = Field(
        default=None, description="an existing Ray cluster ('auto', 'ray://host:10001'); None starts a local Ray"
    )
    roles: dict[str, RoleSpec] = Field(min_length=1, description="the job's roles by name (at least one)")
    max_restarts: int = Field(default=10, ge=0, description="restart budget of the whole job")
    capacity: Resources = Field(
        default_factory=_this_machine,
        description="resources all the job's nodes together may use (default: this machine's CPU cores and "
        "memory, no GPU); sizes a local Ray",
    )
    heartbeat_interval_s: float = Field(default=0.5, gt=0, description="seconds between a node's heartbeats")
    monitor_interval_s: float = Field(default=0.1, gt=0, description="seconds between the master's health checks")
    start_timeout_s: float = Field(default=30.0, gt=0, description="create -> checked deadline per node")
    rpc_timeout_s: float = Field(
        default=10.0, gt=0, description="seconds a control call to a node may take (also bounds check_child())"
    )
    stop_grace_s: float = Field(
        default=3.0, ge=0, description="seconds stopped nodes get to exit before they are killed"
    )
    master_lost_timeout_s: float = Field(default=60.0, gt=0, description="a node alone this long stops itself")
    preload: list[str] = Field(
        default_factory=list,
        description="modules the local backend imports once, in the fork server its nodes start from: what "
        "every node imports anyway (torch, transformers); each must start no thread at import",
    )

    def role_order(self) -> list[str]:
        """Start order: workers first, sub-masters next, drivers last (drivers call the others)."""
        rank = {"worker": 0, "submaster": 1, "driver": 2}
        return sorted(self.roles, key=lambda name: rank[self.roles[name].kind])


def parse_job(data: dict[str, Any], source: str = "<job>") -> JobSpec:
    """Validate a mapping into a `JobSpec` and check its entry points and groups."""
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as error:
        raise JobSpecError(format_validation_error(source, error)) from None
    check_job(spec, source)
    return spec


def load_job(path: str | Path) -> JobSpec:
    return parse_job(read_toml(path), source=str(path))


def check_job(spec: JobSpec, source: str = "<job>") -> None:
    """The checks pydantic cannot do field by field: names, entry points and colocation groups."""
    from rlplex.control.node.worker import load_entrypoint

    # Job, role and node names become file names (node logs, elastic status files) and Ray actor
    # names: a role named "../../x" must not write outside the output folder.
    if not is_safe_name(spec.name):
        raise JobSpecError(f"{source}: field 'name': {spec.name!r} is not a valid job name (expected {SAFE_NAME_RULE})")
    for name in spec.roles:
        if not is_safe_name(name):
            raise JobSpecError(
                f"{source}: field 'roles': {name!r} is not a valid role name (expected {SAFE_NAME_RULE})"
            )
    for module in spec.preload:
        if not _importable(module):
            raise JobSpecError(f"{source}: field 'preload': no module named {module!r}")
    for name, role in spec.roles.items():
        try:
            worker = load_entrypoint(role.entrypoint, role.kind)
        except JobSpecError as error:
            raise JobSpecError(f"{source}: role '{name}': field 'entrypoint': {error}") from None
        check_role_config(worker, role, f"{source}: role '{name}'")
    groups: dict[str, list[str]] = {}
    for name, role in spec.roles.items():
        if role.colocate is not None:
            groups.setdefault(role.colocate, []).append(name)
    for group, members in groups.items():
        kinds = {spec.roles[m].kind for m in members}
        if len(members) > 1 and kinds & {"driver", "submaster"}:
            raise JobSpecError(
                f"{source}: role '{members[1]}': field 'colocate': group '{group}' mixes kinds {sorted(kinds)}; "
                "drivers and sub-masters cannot share a colocation group"
            )
        counts = {spec.roles[m].count for m in members}
        if len(counts) > 1:
            shown = ", ".join(f"{m}={spec.roles[m].count}" for m in members)
            raise JobSpecError(
                f"{source}: role '{members[1]}': field 'colocate': roles of group '{group}' need equal counts ({shown})"
            )


def _importable(module: str) -> bool:
    """Whether `module` can be found, without importing it or its parents: `find_spec` of a
    dotted name would import the packages above it (torch, transformers: seconds at every load)."""
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):  # an empty or odd name
        return False
    for depth in range(1, len(rest) + 1):
        if spec is None or spec.submodule_search_locations is None:
            return False
        name = ".".join([top, *rest[:depth]])
        spec = (
            sys.modules[name].__spec__
            if name in sys.modules
            else PathFinder.find_spec(name, list(spec.submodule_search_locations))
        )
    return spec is not None


def check_role_config(worker: type[Any], role: RoleSpec, where: str) -> None:
    """The role's `config` against the model its worker class declares (`Worker.config_model`)."""
    try:
        worker.validate_config(role.config)
    except ValidationError as error:
        raise JobSpecError(format_validation_error(where, nested_error(error, "config"))) from None
    except JobSpecError as error:
        raise JobSpecError(f"{where}: {error}") from None


def nested_error(error: ValidationError, *outer: str | int) -> ValidationError:
    """The same errors with each field path under `outer`, as the job file spells it."""
    items = [{**item, "loc": (*outer, *item["loc"])} for item in error.errors()]
    return ValidationError.from_exception_data(error.title, items)  # type: ignore[arg-type]


class JobBuilder:
    """A small Python way to declare a job: `JobBuilder("demo", out).role("w", entrypoint=...).build()`."""

    def __init__(self, name: str, output_dir: str | Path, **job_fields: Any) -> None:
        self._data: dict[str, Any] = {"name": name, "output_dir": str(output_dir), "roles": {}, **job_fields}

    def role(self, name: str, *, entrypoint: str, **fields: Any) -> JobBuilder:
        if name in self._data["roles"]:
            raise JobSpecError(f"role '{name}' declared twice")
        self._data["roles"][name] = {"entrypoint": entrypoint, **fields}
        return self

    def build(self) -> JobSpec:
        return parse_job(self._data, source=f"job '{self._data['name']}'")
