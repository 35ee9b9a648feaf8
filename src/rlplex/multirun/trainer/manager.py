"""`MultiRunManager`: one trainer, many runs, each in a slot of the shared LoRA modules.

```
 rank 0 (master)                              every rank
 discover_runs()                              synchronize_state()
   1 scan run_*                                 1 master publishes snapshot v (JSON, store key per v)
   2 drop evicted, finished                     2 others read v, catch up (_delete/_create_run_data)
   3 new / deleted                              (hook names compared when runs change)
   4 forgotten hooks (deleted)                  3 deletion hooks, registration order
   5 load + validate orch.toml (new)            4 creation hooks, registration order
   6 update id_2_idx / idx_2_id
   7 discovered hooks (new)
```

A run is known by its name and its identity (`control/identity`, see `rundir`): a directory
deleted and made again under the same name is a new run, even when it got the old inode back,
and the old run's queued writes are refused by the new directory. An active run's `orch.toml`
is frozen: a change to what it says evicts the run with the fields that changed (the trainer
would otherwise keep scoring at the old temperature), a rewrite of the same config is ignored.
When `control/evicted.txt` cannot be written (a full disk, a `control/` that is a symlink) the
run still leaves training: its eviction is recorded beside the runs (`evictions/<run id>.json`,
see `rundir.write_eviction`), which this trainer's every scan, the next trainer, the run's
orchestrator and `rlplex status` read (in memory only when even that cannot be written).

A run's status is one of `active` (has a slot), `waiting` (valid, no free slot),
`rejected` (orch.toml invalid: `control/config_validation_error.txt` says why; re-read when
the file changes), `pending` (no orch.toml yet), `evicted` (`control/evicted.txt`) and
`finished` (`control/finished.txt`, written by the trainer once the run's last step is
checkpointed and broadcast). Evicted and finished runs are closed: they leave their slot like
a deleted run (forgotten and deletion hooks, the slot back to the free pool, waiting runs
admitted into it), keep their files, and are not admitted again while the file is there.
Every decision that ranks must agree on (which runs exist, in which slot, from which
checkpoint they resume) is taken on rank 0 and travels in the snapshot.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlplex.errors import CheckpointError, MultiRunError, RunConfigError
from rlplex.multirun.orchestrator.config import (
    OrchestratorConfig,
    frozen_config_reason,
    parse_orch_config,
    read_orch_config,
)
from rlplex.multirun.rundir import (
    RunDir,
)
from rlplex.multirun.rundir.checkpoint import (
    RunProgress,
    choose_resume,
    latest_stable_checkpoint_path,
    save_checkpoint,
)
from rlplex.multirun.trainer.adapters import AdapterRegistry, LoraModule
from rlplex.multirun.trainer.discovery import CLOSED_STATUSES, RunLedger, RunScanner, RunStatus, signature_of
from rlplex.multirun.trainer.hooks import (
    ConfigValidationHook,
    DiscoveredHook,
    ForgottenHook,
    Hooks,
    RunHook,
)
from rlplex.multirun.trainer.lora import AdapterBatch
from rlplex.multirun.trainer.sync import ProgressEntry, ResumeEntry, RunEntry, StoreChannel, SyncSnapshot

log = logging.getLogger(__name__)

EMPTY_SLOT_SCALING = 1e6
"""Scaling factor of an empty slot: an adapter used without a run shows up loudly."""


class MultiRunManager(AdapterRegistry):
    def __init__(
        self,
        output_dir: Path,
        max_runs: int,
        *,
        store: dist.Store | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        store_prefix: str = "rlplex/multirun/0",
        sync_timeout_s: float = 300.0,
    ) -> None:
        if max_runs < 1:
            raise MultiRunError(f"max_runs must be at least 1, got {max_runs}")
        distributed = dist.is_available() and dist.is_initialized()
        self.output_dir = Path(output_dir)
        self.max_runs = max_runs
        self.rank = rank if rank is not None else (dist.get_rank() if distributed else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if distributed else 1)
        self._store = store
        self._store_prefix = store_prefix
        self._sync_timeout_s = sync_timeout_s
        self._channel: StoreChannel | None = None

        self.id_2_idx: dict[str, int] = {}
        self.idx_2_id: dict[int, str] = {}
        self.config: dict[int, OrchestratorConfig] = {}
        self.progress: dict[int, RunProgress] = {}
        self.scaling_factors = torch.full((max_runs,), EMPTY_SLOT_SCALING, dtype=torch.float32)
        self.lora_ranks = torch.zeros(max_runs, dtype=torch.int64)
        self.adapter_batch = AdapterBatch()
        self.hooks = Hooks()
        self.lora_modules: dict[str, LoraModule] = {}

        self._incarnation: dict[int, int] = {}
        self._resume: dict[int, ResumeEntry] = {}
        self._next_incarnation = 0
        self._synced: dict[int, RunEntry] = {}
        self._sync_version = 0

        # Master-only: the runs without a slot, and who each run is.
        self._scanner = RunScanner(self.output_dir)
        self._ledger = RunLedger(self.output_dir, self._validate, self.is_master)

        self.register_discovered_hook(self._set_lora_scaling, name="rlplex.multirun.set_lora_scaling")
        self.register_creation_hook(self._reset_new_run, name="rlplex.multirun.reset_run_parameters")

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def _require_master(self, what: str) -> None:
        if not self.is_master:
            raise MultiRunError(f"{what}() runs on the master rank only (this is rank {self.rank})")

    def run_dir(self, run_id: str) -> RunDir:
        """The run's directory, bound to the identity the master knows it by (writes check it)."""
        return self._ledger.run_dir(run_id)

    def is_leaving(self, run_id: str) -> bool:
        """True once the run is evicted or finished: it must not be trained, even before it leaves its slot."""
        return self._ledger.is_closed(run_id)

    # ---- hooks -------------------------------------------------------------------------------
    def register_discovered_hook(self, hook: DiscoveredHook, name: str | None = None) -> None:
        self.hooks.discovered.add(hook, name)

    def register_forgotten_hook(self, hook: ForgottenHook, name: str | None = None) -> None:
        self.hooks.forgotten.add(hook, name)

    def register_creation_hook(self, hook: RunHook, name: str | None = None) -> None:
        self.hooks.creation.add(hook, name)

    def register_deletion_hook(self, hook: RunHook, name: str | None = None) -> None:
        self.hooks.deletion.add(hook, name)

    def register_config_validation_hook(self, hook: ConfigValidationHook, name: str | None = None) -> None:
        self.hooks.config_validation.add(hook, name)

    # ---- statuses ----------------------------------------------------------------------------
    def run_statuses(self) -> dict[str, RunStatus]:
        """Every `run_*` directory known at the last scan (master) or the active runs (others)."""
        statuses: dict[str, RunStatus] = dict(self._ledger.status)
        statuses.update({run_id: "active" for run_id in self.id_2_idx if statuses.get(run_id) not in CLOSED_STATUSES})
        return dict(sorted(statuses.items()))

    def status_reason(self, run_id: str) -> str | None:
        """Why a run is rejected, evicted or finished (None otherwise)."""
        return self._ledger.reasons.get(run_id)

    # ---- discovery (master) ------------------------------------------------------------------
    def discover_runs(self) -> None:
        """Master only: bring the run table up to date with `output_dir` (the seed's seven steps)."""
        self._require_master("discover_runs")
        scan = self._scanner.scan()  # 1 (and 2: evicted and finished runs are listed apart)
        replaced = self._ledger.replaced(scan.inodes)
        for name in replaced:
            self._ledger.forget(name)
        unwritten = set(scan.live) & self._ledger.evicted_elsewhere()
        live = set(scan.live) - unwritten
        deleted = [
            (idx, run_id) for run_id, idx in self.id_2_idx.items() if run_id not in live or run_id in replaced
        ]  # 3
        closed: dict[str, RunStatus] = {name: "evicted" for name in [*scan.evicted, *unwritten]}
        closed.update({name: "finished" for name in scan.finished})
        self._ledger.update_unslotted(live, closed, self.id_2_idx)
        self._check_frozen_configs(live - replaced)
        for idx, run_id in deleted:  # 4
            for _, hook in self.hooks.forgotten:
                hook(idx, run_id)
        for idx, _ in deleted:  # 6 (frees the slots the new runs take)
            self._delete_run_data(idx)

        new = [name for name in scan.live if name not in self.id_2_idx and name not in self._ledger.status]
        self._ledger.judge(new)  # 5
        for name, signature in list(self._ledger.unadmitted.items()):
            if name not in new and signature_of(self.run_dir(name).orch_config) != signature:
                self._ledger.judge([name])  # a rejected or pending run whose orch.toml changed

        admitted = self._admit_waiting()  # 6
        for idx, run_id in admitted:  # 7
            for _, hook in self.hooks.discovered:
                hook(idx, run_id, self.config[idx])

    def _check_frozen_configs(self, live: set[str]) -> None:
        """Evict an active run whose orch.toml now says something else (see the module docstring)."""
        for name, idx in list(self.id_2_idx.items()):
            if name not in live or self.is_leaving(name):
                continue
            run = self.run_dir(name)
            signature = signature_of(run.orch_config)
            if signature == self._ledger.active_signatures.get(name):
                continue
            try:
                config = read_orch_config(run.orch_config, within=run.root)
            except RunConfigError as error:
                self.evict_run(idx, f"{run.orch_config} changed while the run was active and no longer reads: {error}")
                continue
            if config == self.config[idx]:
                self._ledger.active_signatures[name] = signature  # rewritten with the same config
                continue
            self.evict_run(idx, frozen_config_reason(run.orch_config, self.config[idx], config))

    def _validate(self, config: OrchestratorConfig, run: RunDir) -> None:
        limit = self.max_lora_rank()
        if limit is not None and config.model.lora.rank > limit:
            raise RunConfigError(
                f"{run.orch_config}: field 'model.lora.rank': {config.model.lora.rank} is more than "
                f"the trainer's maximum LoRA rank {limit}"
            )
        for name, hook in self.hooks.config_validation:
            try:
                ok, message = hook(config)
            except Exception as error:  # a broken validator must reject the run, not stop the trainer
                ok, message = False, f"validation hook {name} raised {type(error).__name__}: {error}"
            if not ok:
                raise RunConfigError(f"{run.orch_config}: rejected by {name}: {message}")

    def _admit_waiting(self) -> list[tuple[int, str]]:
        admitted: list[tuple[int, str]] = []
        free = [idx for idx in range(self.max_runs) if idx not in self.idx_2_id]
        for name in list(self._ledger.waiting):
            if not free:
                break
            signature, config = self._ledger.waiting[name]
            run = self.run_dir(name)
            if signature_of(run.orch_config) != signature:
                self._ledger.judge([name])  # rewritten while waiting: judge the new file
                if name not in self._ledger.waiting:
                    continue
                signature, config = self._ledger.waiting[name]
            del self._ledger.waiting[name]
            self._ledger.status.pop(name, None)
            try:
                point = choose_resume(run)
            except CheckpointError as error:
                self._ledger.close_as_evicted(name, f"cannot resume: {error}")
                continue
            idx = free.pop(0)
            self._next_incarnation += 1
            resume = ResumeEntry(checkpoint=point.checkpoint, adapter=point.adapter)
            self._create_run_data(idx, name, config, self._next_incarnation, point.progress, resume)
            self._ledger.active_signatures[name] = signature
            admitted.append((idx, name))
        return admitted

    # ---- run data (all ranks) ----------------------------------------------------------------
    def _create_run_data(
        self,
        idx: int,
        run_id: str,
        config: OrchestratorConfig,
        incarnation: int,
        progress: RunProgress,
        resume: ResumeEntry,
    ) -> None:
        if idx in self.idx_2_id:
            raise MultiRunError(f"slot {idx} already holds {self.idx_2_id[idx]}; cannot place {run_id}")
        self.id_2_idx[run_id] = idx
        self.idx_2_id[idx] = run_id
        self.config[idx] = config
        self.progress[idx] = progress
        self._incarnation[idx] = incarnation
        self._resume[idx] = resume
        if not self.is_master:
            self._set_lora_scaling(idx, run_id, config)  # the discovered hook ran on the master only

    def _delete_run_data(self, idx: int) -> None:
        run_id = self.idx_2_id.pop(idx)
        del self.id_2_idx[run_id]
        for table in (self.config, self.progress, self._incarnation, self._resume):
            table.pop(idx, None)
        self.scaling_factors[idx] = EMPTY_SLOT_SCALING
        self.lora_ranks[idx] = 0

    def _set_lora_scaling(self, idx: int, run_id: str, config: OrchestratorConfig) -> None:
        self.scaling_factors[idx] = config.model.lora.alpha / config.model.lora.rank
        self.lora_ranks[idx] = config.model.lora.rank

    def _reset_new_run(self, idx: int, run_id: str) -> None:
        self.reset_run_parameters(idx)

    def record_progress(self, idx: int, tokens: int, samples: int) -> RunProgress:
        """Count one finished step of the run in slot `idx`."""
        progress = self.progress[idx]
        progress.step += 1
        progress.total_tokens += tokens
        progress.total_samples += samples
        return progress

    def resume_step(self, idx: int) -> int | None:
        """The stable checkpoint step this run resumes from, as decided on rank 0 (None: fresh start)."""
        entry = self._resume.get(idx)
        return None if entry is None else entry.checkpoint

    def resume_checkpoint_path(self, idx: int) -> Path | None:
        step = self.resume_step(idx)
        return None if step is None else self.run_dir(self.idx_2_id[idx]).checkpoint_step(step)

    def resume_adapter_path(self, idx: int) -> Path | None:
        """The broadcast adapter, newer than the checkpoint, that this run's weights resume from."""
        entry = self._resume.get(idx)
        if entry is None or entry.adapter is None:
            return None
        return self.run_dir(self.idx_2_id[idx]).broadcast_step(entry.adapter)

    # ---- synchronisation (all ranks) ---------------------------------------------------------
    def synchronize_state(self) -> None:
        """Collective: every rank ends with rank 0's run table and has run the deletion, then creation hooks."""
        version = self._sync_version
        self._sync_version += 1
        mine = self.hooks.collective_names()
        if self.is_master:
            snapshot = self._make_snapshot(version, mine)
        channel = self._get_channel()
        if channel is not None:
            if self.is_master:
                channel.publish(snapshot)
            else:
                snapshot = channel.receive(version)
            if snapshot.check_hooks:
                channel.check_hooks(version, mine, snapshot.hooks)
            channel.ack(version)
        if not self.is_master:
            self._catch_up(snapshot)
        deleted = [(idx, e.run_id) for idx, e in self._synced.items() if snapshot.runs.get(idx) != e]
        created = [(idx, e.run_id) for idx, e in sorted(snapshot.runs.items()) if self._synced.get(idx) != e]
        self._synced = dict(snapshot.runs)
        for idx, run_id in sorted(deleted):
            for _, hook in self.hooks.deletion:
                hook(idx, run_id)
        for idx, run_id in created:
            for _, hook in self.hooks.creation:
                hook(idx, run_id)

    def _get_channel(self) -> StoreChannel | None:
        if self.world_size == 1:
            return None
        if self._channel is None:
            store = self._store
            if store is None:
                if not dist.is_initialized():
                    raise MultiRunError("synchronize_state() at world size > 1 needs torch.distributed or a store")
                store = dist.distributed_c10d._get_default_store()
            self._channel = StoreChannel(store, self.rank, self.world_size, self._store_prefix, self._sync_timeout_s)
        return self._channel

    def _make_snapshot(self, version: int, hooks: dict[str, list[str]]) -> SyncSnapshot:
        runs = {idx: RunEntry(run_id=rid, incarnation=self._incarnation[idx]) for idx, rid in self.idx_2_id.items()}
        changed = [idx for idx, entry in runs.items() if self._synced.get(idx) != entry]
        return SyncSnapshot(
            version=version,
            runs=runs,
            configs={self.idx_2_id[idx]: self.config[idx].model_dump() for idx in changed},
            resume={idx: self._resume[idx] for idx in changed},
            progress={idx: ProgressEntry(**p.state_dict()) for idx, p in self.progress.items()},
            hooks=hooks,
            check_hooks=version == 0 or bool(changed) or set(self._synced) != set(runs),
        )

    def _catch_up(self, snapshot: SyncSnapshot) -> None:
        for idx, run_id in list(self.idx_2_id.items()):
            if snapshot.runs.get(idx) != RunEntry(run_id=run_id, incarnation=self._incarnation[idx]):
                self._delete_run_data(idx)
        for idx, entry in sorted(snapshot.runs.items()):
            if idx in self.idx_2_id:
                continue
            config = parse_orch_config(snapshot.configs[entry.run_id], f"<snapshot {snapshot.version}>")
            progress = RunProgress(**snapshot.progress[idx].model_dump())
            self._create_run_data(idx, entry.run_id, config, entry.incarnation, progress, snapshot.resume[idx])
        for idx, reported in snapshot.progress.items():
            self.progress[idx] = RunProgress(**reported.model_dump())

    # ---- eviction (master) -------------------------------------------------------------------
    def evict_run(self, idx: int, reason: str) -> None:
        """Master only: write `control/evicted.txt`; the run leaves on the next `discover_runs()`."""
        self._require_master("evict_run")
        if idx not in self.idx_2_id:
            raise MultiRunError(f"evict_run: slot {idx} holds no run (active slots: {sorted(self.idx_2_id)})")
        run_id = self.idx_2_id[idx]
        log.warning("evicting run %s (slot %d): %s", run_id, idx, reason)
        self._ledger.close_as_evicted(run_id, reason)

    # ---- per-run checkpoints -----------------------------------------------------------------
    def save_run_checkpoint(
        self,
        idx: int,
        step: int,
        adapter_state: dict[str, Any],
        optimizer_state: dict[str, Any],
        scheduler_state: dict[str, Any],
        *,
        run_id: str | None = None,
    ) -> Path:
        """Write `checkpoints/step_<step>` of the run in slot `idx` (with its progress), STABLE last.

        Pass the `run_id` the state belongs to: if the slot has since been given to another run
        the write is refused instead of landing in the new run's directory.
        """
        if idx not in self.idx_2_id:
            raise MultiRunError(f"save_run_checkpoint: slot {idx} holds no run (was it deleted or evicted?)")
        owner = self.idx_2_id[idx]
        if run_id is not None and run_id != owner:
            raise MultiRunError(f"save_run_checkpoint: slot {idx} now holds {owner}, not {run_id}; not written")
        return save_checkpoint(
            self.run_dir(owner), step, adapter_state, optimizer_state, scheduler_state, self.progress[idx]
        )

    def latest_stable_checkpoint(self, run_id: str) -> Path | None:
        """The newest `checkpoints/step_N` with a STABLE marker, read from disk on this rank."""
        return latest_stable_checkpoint_path(self.run_dir(run_id))


_MANAGER: MultiRunManager | None = None
_SETUPS = 0


def setup_multi_run_manager(output_dir: Path | str, max_runs: int, **kwargs: Any) -> MultiRunManager:
    """Create the process-wide manager (replacing any previous one) and return it.

    Every rank calls this the same number of times, so numbering the setups gives each
    manager its own store keys: a replaced manager's leftover keys cannot be misread.
    """
    global _MANAGER, _SETUPS
    _SETUPS += 1
    kwargs.setdefault("store_prefix", f"rlplex/multirun/{_SETUPS}")
    _MANAGER = MultiRunManager(Path(output_dir), max_runs, **kwargs)
    return _MANAGER


def get_multi_run_manager() -> MultiRunManager:
    if _MANAGER is None:
        raise MultiRunError("the multi-run manager is not set up: call setup_multi_run_manager(output_dir, max_runs)")
    return _MANAGER
