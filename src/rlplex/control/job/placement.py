"""Roles into bundles of resources, refused before anything starts when they cannot fit.

One bundle per node, except colocated roles: rank i of every role in a colocation group
shares bundle i (its resources are the sum). The local backend has one machine, so the sum
of all bundles must fit the job's capacity; on Ray each bundle becomes a placement-group
bundle and the same per-bundle check applies to the largest machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlplex.control.job.spec import JobSpec, Resources
from rlplex.errors import PlacementError


@dataclass(frozen=True)
class Member:
    role: str
    rank: int

    @property
    def node_id(self) -> str:
        return node_id(self.role, self.rank)


def node_id(role: str, rank: int) -> str:
    return f"{role}-{rank}"


@dataclass(frozen=True)
class Bundle:
    index: int
    cpu: float
    gpu: float
    memory_mb: int
    custom: tuple[tuple[str, float], ...]
    members: tuple[Member, ...]


def _add(a: dict[str, float], r: Resources) -> None:
    a["cpu"] = a.get("cpu", 0.0) + r.cpu
    a["gpu"] = a.get("gpu", 0.0) + r.gpu
    a["memory_mb"] = a.get("memory_mb", 0.0) + r.memory_mb
    for key, value in r.custom.items():
        a[key] = a.get(key, 0.0) + value


def _capacity(r: Resources) -> dict[str, float]:
    out: dict[str, float] = {}
    _add(out, r)
    return out


class Placement:
    """`allocate(spec) -> list[Bundle]`, raising `PlacementError` naming the first role that does not fit."""

    @staticmethod
    def allocate(spec: JobSpec, roles: dict[str, int] | None = None) -> list[Bundle]:
        """Bundles for every node; `roles` overrides role counts (scaling asks "does this still fit?")."""
        counts = {name: role.count for name, role in spec.roles.items()} | (roles or {})
        groups: dict[str, list[str]] = {}
        units: list[list[str]] = []  # roles placed together, rank by rank
        for name in spec.role_order():
            group = spec.roles[name].colocate
            if group is None:
                units.append([name])
            elif group not in groups:
                groups[group] = [name]
                units.append(groups[group])
            else:
                groups[group].append(name)

        capacity = _capacity(spec.capacity)
        used: dict[str, float] = {}
        bundles: list[Bundle] = []
        for unit in units:
            for rank in range(max(counts[name] for name in unit)):
                need: dict[str, float] = {}
                members = tuple(Member(name, rank) for name in unit if rank < counts[name])
                for member in members:
                    _add(need, spec.roles[member.role].resources)
                for key, amount in need.items():
                    if amount <= 0:
                        continue
                    left = capacity.get(key, 0.0) - used.get(key, 0.0)
                    if amount > left + 1e-9:
                        raise PlacementError(
                            f"role '{unit[0]}' rank {rank}: needs {key}={amount:g} but only {max(left, 0):g} of "
                            f"{capacity.get(key, 0.0):g} is left (job '{spec.name}' asks for more than its capacity)"
                        )
                for key, amount in need.items():
                    used[key] = used.get(key, 0.0) + amount
                bundles.append(
                    Bundle(
                        index=len(bundles),
                        cpu=need.get("cpu", 0.0),
                        gpu=need.get("gpu", 0.0),
                        memory_mb=int(need.get("memory_mb", 0)),
                        custom=tuple(sorted((k, v) for k, v in need.items() if k not in ("cpu", "gpu", "memory_mb"))),
                        members=members,
                    )
                )
        return bundles
