"""The five hook kinds of the multi-run manager, kept in registration order.

Discovered, forgotten and config-validation hooks run on the master only (inside
`discover_runs`). Creation and deletion hooks run on every rank inside `synchronize_state`,
deletion before creation, so they may call collectives (`torch.distributed.barrier()`).
That only works if every rank registered the same hooks in the same order; the names
returned by `collective_names()` are published with each state snapshot and compared.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from rlplex.multirun.orchestrator.config import OrchestratorConfig

DiscoveredHook = Callable[[int, str, "OrchestratorConfig"], None]
ForgottenHook = Callable[[int, str], None]
RunHook = Callable[[int, str], None]
ConfigValidationHook = Callable[["OrchestratorConfig"], tuple[bool, str]]

F = TypeVar("F", bound=Callable[..., object])


def hook_name(fn: Callable[..., object]) -> str:
    target = fn.func if isinstance(fn, functools.partial) else fn
    module = getattr(target, "__module__", None) or "?"
    qualname = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{module}.{qualname}"


@dataclass
class HookList(Generic[F]):
    """Callbacks of one kind with their names (for mismatch reports)."""

    hooks: list[tuple[str, F]] = field(default_factory=list)

    def add(self, fn: F, name: str | None = None) -> None:
        self.hooks.append((name or hook_name(fn), fn))

    def names(self) -> list[str]:
        return [name for name, _ in self.hooks]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.hooks)

    def __len__(self) -> int:
        return len(self.hooks)


@dataclass
class Hooks:
    discovered: HookList[DiscoveredHook] = field(default_factory=HookList)
    forgotten: HookList[ForgottenHook] = field(default_factory=HookList)
    creation: HookList[RunHook] = field(default_factory=HookList)
    deletion: HookList[RunHook] = field(default_factory=HookList)
    config_validation: HookList[ConfigValidationHook] = field(default_factory=HookList)

    def collective_names(self) -> dict[str, list[str]]:
        """The hooks every rank runs together; they must be identical on every rank."""
        return {"deletion": self.deletion.names(), "creation": self.creation.names()}


def describe_mismatch(rank: int, mine: dict[str, list[str]], master: dict[str, list[str]]) -> str:
    parts = []
    for kind in ("deletion", "creation"):
        if mine.get(kind) != master.get(kind):
            parts.append(f"{kind} hooks on rank {rank}: {mine.get(kind)} but on rank 0: {master.get(kind)}")
    return (
        "hook registration differs between ranks (register the same creation/deletion hooks in the same "
        "order on every rank, before synchronize_state): " + "; ".join(parts)
    )
