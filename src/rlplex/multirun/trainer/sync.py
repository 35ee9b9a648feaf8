"""The run state the master shares with the other ranks, and how it travels.

Each `synchronize_state()` call is collective and numbered: call k on every rank deals with
snapshot version k. The master writes version k as validated JSON under its own store key
(never pickle); the others wait for that key with a timeout. Every rank then adds 1 to an ack
counter, and the rank that completes the count deletes the keys, so the store stays small.

When the snapshot brings runs in or out (or on the first call), the creation and deletion
hooks are about to run on every rank and may call collectives; so before running them the
ranks check that they registered the same hooks: each non-master posts its hook names, the
master compares and posts a verdict, and every rank raises the same `HookMismatchError`
rather than some ranks entering a barrier that the others never reach.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, ValidationError

from rlplex.errors import HookMismatchError, MultiRunError, WaitTimeoutError

OK = "ok"


class RunEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: str
    incarnation: int


class ResumeEntry(BaseModel):
    """Where a new run resumes: optimizer state from checkpoint step, adapter from broadcast step."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: int | None = None
    adapter: int | None = None


class ProgressEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step: int
    total_tokens: int
    total_samples: int


class SyncSnapshot(BaseModel):
    """Version `version` of the master's run table."""

    model_config = ConfigDict(extra="forbid")

    version: int
    runs: dict[int, RunEntry]
    configs: dict[str, dict[str, Any]]
    resume: dict[int, ResumeEntry]
    progress: dict[int, ProgressEntry]
    hooks: dict[str, list[str]]
    check_hooks: bool


class StoreChannel:
    """Snapshot exchange over a torch.distributed store (TCPStore / PrefixStore)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, prefix: str, timeout_s: float) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix
        self.timeout = timedelta(seconds=timeout_s)

    def _key(self, kind: str, version: int, rank: int | None = None) -> str:
        suffix = "" if rank is None else f"/{rank}"
        return f"{self.prefix}/{kind}/{version}{suffix}"

    def _wait(self, key: str, what: str) -> bytes:
        try:
            self.store.wait([key], self.timeout)
            return self.store.get(key)
        except RuntimeError as error:  # DistStoreError subclasses RuntimeError
            raise WaitTimeoutError(
                f"rank {self.rank}: waited {self.timeout.total_seconds():.0f} s for {what} (store key {key!r}); "
                f"is rank 0 alive and calling synchronize_state the same number of times? ({error})"
            ) from None

    def publish(self, snapshot: SyncSnapshot) -> None:
        self.store.set(self._key("snapshot", snapshot.version), snapshot.model_dump_json())

    def receive(self, version: int) -> SyncSnapshot:
        raw = self._wait(self._key("snapshot", version), f"multi-run state snapshot version {version}")
        try:
            snapshot = SyncSnapshot.model_validate_json(raw)
        except ValidationError as error:
            raise MultiRunError(f"rank {self.rank}: malformed state snapshot version {version}: {error}") from None
        if snapshot.version != version:
            raise MultiRunError(f"rank {self.rank}: expected state snapshot version {version}, got {snapshot.version}")
        return snapshot

    def check_hooks(self, version: int, mine: dict[str, list[str]], master: dict[str, list[str]]) -> None:
        """Collective: raise `HookMismatchError` on every rank if any rank's hooks differ from rank 0's."""
        from rlplex.multirun.trainer.hooks import describe_mismatch

        verdict_key = self._key("verdict", version)
        if self.rank != 0:
            self.store.set(self._key("hooks", version, self.rank), json.dumps(mine))
            verdict = self._wait(verdict_key, f"the hook-registration verdict of version {version}").decode()
        else:
            problems = []
            for rank in range(1, self.world_size):
                key = self._key("hooks", version, rank)
                theirs = json.loads(self._wait(key, f"the hook names of rank {rank}"))
                self.store.delete_key(key)
                if theirs != master:
                    problems.append(describe_mismatch(rank, theirs, master))
            verdict = "\n".join(problems) or OK
            self.store.set(verdict_key, verdict)
        if verdict != OK:
            raise HookMismatchError(f"rank {self.rank}: {verdict}")

    def ack(self, version: int) -> None:
        """Count this rank done with `version`; the last rank to finish deletes its keys."""
        ack_key = self._key("ack", version)
        if self.store.add(ack_key, 1) == self.world_size:
            for key in (self._key("snapshot", version), self._key("verdict", version), ack_key):
                self.store.delete_key(key)
