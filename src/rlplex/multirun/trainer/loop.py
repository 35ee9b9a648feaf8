"""`MultiRunTrainer`: one trainer, many runs, on one rank or a torch.distributed group.

```
 every iteration                       rank 0                         every rank
 1 discover_runs()                     scan run_*, admit, evict
 2 synchronize_state()                                                 deletion, creation hooks
 3 stop?                                                               all-reduce(max) of stop flags
 4 read ready rollouts/step_s          validate (malformed: evict)
 5 pack (fair by loss tokens)          plan -> micro-batches
 6 broadcast plan                      header + tensors (no pickle) ->
 7 forward/backward                                                    micro-batches i = rank mod W
 8 step the runs whose step is whole                                   all-reduce grads, clip, step
 9 publish                             broadcast/step_{s+1}, checkpoints/step_{s+1}, progress.csv
```

A run trains step s from `rollouts/step_s`; after its optimizer step its progress step is
s + 1 and `broadcast/step_{s+1}` appears (with the trainer's counters beside the adapter, so
that a restart resumes from it: no step is trained twice whatever `checkpoint_every` is). A
step whose rollouts are more than `max_off_policy_steps` behind (step - policy_step) is not
trained: it counts as done with no update, and the run's log counts it in `stale_dropped`. A
step whose loss or gradient is not finite is not applied: the optimizer step is skipped and the
run is evicted with the reason, so nothing non-finite is ever checkpointed or broadcast. A run
whose `loss.decoupled` is set trains with AReaL's decoupled PPO objective (`_decoupled_anchor`),
row by row beside runs that train with plain PPO in the same micro-batches. When a
run is created (fresh or resumed),
`broadcast/step_<its step>` is written if missing, so its orchestrator can start. A run trained
to its `max_steps` is marked finished (`control/finished.txt`) by a writer job queued behind its
final checkpoint and broadcast; the next `discover_runs()` frees its slot for a waiting run.

Entry points: `run_trainer(TrainerConfig)` (`trainer.main`; the main job's trainer role runs it
through `rlplex.control.elastic.entry`), and the standalone CLI, torchrun-style (RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT when present): `python -m rlplex.multirun.trainer --output-dir D
--max-runs K [--steps N] [--until-idle S]`. It stops cleanly on SIGTERM / SIGINT (in the main
job: the control plane's stop of the trainer role), writing a checkpoint of every run whose
progress is ahead of its last checkpoint.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from rlplex.algos.rl_math import clipped_surrogate
from rlplex.errors import MultiRunError, RunDirGoneError
from rlplex.io.safe_files import write_file_atomic
from rlplex.models.device import resolve_device
from rlplex.models.hf import load_causal_lm, load_tokenizer
from rlplex.models.lm import pad_id_of, token_logprobs
from rlplex.multirun.orchestrator.config import LossConfig, OrchestratorConfig
from rlplex.multirun.rundir.peft_export import is_stable_adapter
from rlplex.multirun.rundir.retention import remove_orphaned_temporaries
from rlplex.multirun.rundir.rollouts import MalformedRolloutError, read_rollouts, rollouts_ready
from rlplex.multirun.trainer.config import TrainerConfig
from rlplex.multirun.trainer.lora_apply import apply_multi_lora
from rlplex.multirun.trainer.manager import MultiRunManager, setup_multi_run_manager
from rlplex.multirun.trainer.outputs import RunOutputs, StepDone
from rlplex.multirun.trainer.packer import MicroBatch, Packer
from rlplex.multirun.trainer.run_optim import RunOptimizers, StepStats

log = logging.getLogger(__name__)
__all__ = ["TIMES_FILE", "MultiRunTrainer", "StepTimes"]

TIMES_FILE = "trainer_times.json"


@dataclass
class Prepared:
    stop: bool
    micro_batches: list[MicroBatch]
    steps: list[StepDone]


@dataclass
class StepTimes:
    """Where this rank's training iterations spend their wall time (perf_counter; on a GPU the
    forward/backward figure is the host's launch time unless the kernels made it wait)."""

    iterations: int = 0
    wall_s: float = 0.0
    forward_backward_s: float = 0.0
    optimizer_s: float = 0.0

    @property
    def host_s(self) -> float:
        """Everything but the maths: reading and packing rollouts, the plan, bookkeeping, outputs."""
        return max(0.0, self.wall_s - self.forward_backward_s - self.optimizer_s)

    def as_dict(self) -> dict[str, float]:
        host_fraction = self.host_s / self.wall_s if self.wall_s else 0.0
        return {
            "iterations": self.iterations,
            "wall_s": self.wall_s,
            "forward_backward_s": self.forward_backward_s,
            "optimizer_s": self.optimizer_s,
            "host_s": self.host_s,
            "host_fraction": host_fraction,
        }


@dataclass
class IterationResult:
    stop: bool
    micro_batches: int
    stepped: list[tuple[int, str, int]]  # (slot, run id, new step)


class MultiRunTrainer:
    """The trainer of every rank. The shared frozen base is `config.model`, loaded with
    `from_pretrained` on its device (the orchestrators load the same checkpoint); runs that
    name another model are rejected with the reason. `base_model` may be passed in: it must
    hold those weights."""

    def __init__(self, config: TrainerConfig, base_model: torch.nn.Module | None = None) -> None:
        self.config = config
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        self.manager: MultiRunManager = setup_multi_run_manager(config.output_dir, config.max_runs)
        self.tokenizer = load_tokenizer(config.model)
        self.device = resolve_device(config.model.device)
        model = base_model if base_model is not None else load_causal_lm(config.model, self.device)
        self.model = model.to(self.device).eval()
        # LoRA weights (and so Adam's state) stay float32 whatever the base's dtype.
        self.lora = apply_multi_lora(
            self.model, config.target_modules, rank=config.max_lora_rank, manager=self.manager, lora_dtype=torch.float32
        )
        self.vocab_size = int(cast(Any, self.model).get_input_embeddings().num_embeddings)
        self.optim = RunOptimizers(self.manager)
        # bf16 matmuls under autocast on a GPU whose base is bf16; LoRA weights stay float32.
        self._autocast = self.device.type == "cuda" and next(self.model.parameters()).dtype == torch.bfloat16
        self.manager.register_creation_hook(self._on_create, name="rlplex.multirun.trainer.initial_broadcast")
        self.manager.register_forgotten_hook(self._on_forgotten, name="rlplex.multirun.trainer.forget")
        self.manager.register_config_validation_hook(self._same_base, name="rlplex.multirun.trainer.same_base")
        self.manager.register_config_validation_hook(self._async_bound, name="rlplex.multirun.trainer.async_bound")
        self.packer = Packer(config.micro_tokens, config.micro_batches * self.world_size, pad_id_of(self.tokenizer))
        self._evicted: set[str] = set()
        self.outputs = RunOutputs(config, self.manager, self.optim, self.lora.fan_in_fan_out)
        self._stop = threading.Event()
        self._rewards: dict[int, tuple[float, int]] = {}
        self.times = StepTimes()

    # ---- set-up ------------------------------------------------------------------------------
    def _same_base(self, config: OrchestratorConfig) -> tuple[bool, str]:
        """Config validation: a run must name the base model this trainer trains."""
        if config.model.identity() == self.config.model.identity():
            return True, ""
        return False, (
            f"field 'model.name': the run's model {config.model.name!r} ({config.model.identity()}) is not "
            f"this trainer's model {self.config.model.name!r} ({self.config.model.identity()})"
        )

    def _async_bound(self, config: OrchestratorConfig) -> tuple[bool, str]:
        """Config validation: every step of a run within max_async_level must be trainable here."""
        limit = self.config.max_off_policy_steps
        if config.max_async_level <= limit:
            return True, ""
        return False, (
            f"field 'max_async_level': {config.max_async_level} is more than the trainer's "
            f"max_off_policy_steps {limit}: its rollouts would be dropped as too stale"
        )

    def request_stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the loop after this iteration (with `finish()`'s checkpoints):
        the process's graceful stop of `rlplex.control.elastic.entry`, also asked before this trainer existed."""
        from rlplex.control.elastic.entry import install_stop_handlers

        asked = self._stop.is_set()
        self._stop = install_stop_handlers()
        if asked:
            self._stop.set()

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    # ---- hooks -------------------------------------------------------------------------------
    def _on_create(self, idx: int, run_id: str) -> None:
        step = self.manager.progress[idx].step
        resumed = self.manager.resume_step(idx)
        self.outputs.checkpoint_due[run_id] = resumed if resumed is not None else -1
        if not self.is_master or idx in self.optim.resume_failures:
            return
        self.packer.drop(idx)
        self._rewards.pop(idx, None)
        run = self.manager.run_dir(run_id)
        # Leftovers of this trainer's writes cut short by a crash (the rollouts are the orchestrator's).
        remove_orphaned_temporaries(run.root, ("checkpoints", "broadcast", "control"))
        if not is_stable_adapter(run.broadcast_step(step), within=run.root):
            self.outputs.broadcast(idx, run_id, step)

    def _on_forgotten(self, idx: int, run_id: str) -> None:
        self.packer.drop(idx)
        self._rewards.pop(idx, None)
        self._evicted.discard(run_id)
        self.outputs.forget(run_id)

    # ---- one iteration -----------------------------------------------------------------------
    def iteration(self, master_stop: bool = False) -> IterationResult:
        """One trainer iteration on every rank; `master_stop` (rank 0's say) ends the loop."""
        started = time.perf_counter()
        result = self.execute(self.prepare(master_stop))
        if result.micro_batches or result.stepped:
            self.times.iterations += 1
            self.times.wall_s += time.perf_counter() - started
        return result

    def prepare(self, master_stop: bool = False) -> Prepared:
        """Steps 1-6: the run table, the stop decision and the packed plan, the same on every rank."""
        if self.is_master:
            self.manager.discover_runs()
        self.manager.synchronize_state()
        stop = self._stop.is_set() or (self.is_master and master_stop)
        if self.world_size > 1:
            flag = torch.tensor([int(stop)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
        micros: list[MicroBatch] = []
        steps: list[StepDone] = []
        if self.is_master and not stop:
            micros, steps = self._plan()
        if self.world_size > 1 and not stop:
            micros, steps = self._broadcast_plan(micros, steps)
        return Prepared(stop, micros, steps)

    def execute(self, prepared: Prepared) -> IterationResult:
        """Steps 7-9: this rank's micro-batches, then the runs whose step is whole."""
        if prepared.stop:
            return IterationResult(True, 0, [])
        started = time.perf_counter()
        for micro in prepared.micro_batches[self.rank :: self.world_size]:
            self._forward_backward(micro)
        self.times.forward_backward_s += time.perf_counter() - started
        stepped = self._step_runs(prepared.steps)
        return IterationResult(False, len(prepared.micro_batches), stepped)

    def _plan(self) -> tuple[list[MicroBatch], list[StepDone]]:
        """Rank 0: read newly ready steps, pack, and take the complete steps out of the packer."""
        steps = []
        for idx, run_id, reason in self.outputs.retry_failed():
            self._evict(idx, run_id, reason)
        for idx, run_id in sorted(self.manager.idx_2_id.items()):
            if run_id in self._evicted or self.manager.is_leaving(run_id) or idx in self.packer.pending:
                continue
            if idx in self.optim.resume_failures:
                self._evict(idx, run_id, self.optim.resume_failures[idx])
                continue
            step = self.manager.progress[idx].step
            run = self.manager.run_dir(run_id)
            if step >= self.manager.config[idx].max_steps:
                self.outputs.mark_finished(idx, run_id, step)
                continue
            if not rollouts_ready(run, step):
                continue
            try:
                batch = read_rollouts(run, step, self.vocab_size)
            except MalformedRolloutError as error:
                self._evict(idx, run_id, str(error))
                continue
            lag = batch.step - batch.policy_step
            if lag > self.config.max_off_policy_steps:
                log.warning(
                    "run %s: step %d dropped: its rollouts come from policy step %d, %d steps behind "
                    "(max_off_policy_steps %d)",
                    run_id,
                    step,
                    batch.policy_step,
                    lag,
                    self.config.max_off_policy_steps,
                )
                steps.append(StepDone(idx, step, 0, 0, dropped=1, policy_step=batch.policy_step))
                continue
            self.packer.add(idx, batch)
        plan = self.packer.plan()
        micros = [self.packer.materialize(pieces) for pieces in plan.micro_batches]
        for idx in plan.completes:
            pending = self.packer.finish(idx)
            b = pending.batch
            self._rewards[idx] = (float(b.rewards.mean()), b.policy_step)
            steps.append(StepDone(idx, b.step, int(b.attention.sum()), b.n, 0, float(b.rewards.mean()), b.policy_step))
        return micros, steps

    def _evict(self, idx: int, run_id: str, reason: str) -> None:
        self._evicted.add(run_id)
        self.packer.drop(idx)
        self.manager.evict_run(idx, reason)

    def _broadcast_plan(
        self, micros: list[MicroBatch], steps: list[StepDone]
    ) -> tuple[list[MicroBatch], list[StepDone]]:
        """Rank 0's plan to every rank as int64 / float32 tensors (the header first)."""
        header_len = torch.zeros(1, dtype=torch.int64)
        if self.is_master:
            fields = [len(micros), len(steps)]
            for m in micros:
                fields += [int(m.tokens.shape[0]), int(m.tokens.shape[1])]
            for s in steps:
                fields += [s.idx, s.step, s.tokens, s.samples, s.dropped]
            header = torch.tensor(fields, dtype=torch.int64)
            header_len[0] = header.numel()
        dist.broadcast(header_len, 0)
        if not self.is_master:
            header = torch.zeros(int(header_len[0]), dtype=torch.int64)
        dist.broadcast(header, 0)
        values = header.tolist()
        n_micro, n_steps = values[0], values[1]
        shapes = [(values[2 + 2 * i], values[3 + 2 * i]) for i in range(n_micro)]
        base = 2 + 2 * n_micro
        if not self.is_master:
            steps = [StepDone(*values[base + 5 * i : base + 5 * i + 5]) for i in range(n_steps)]
        received = []
        for i, (rows, width) in enumerate(shapes):
            if self.is_master:
                ints, floats = micros[i].to_wire()
            else:
                n_ints, n_floats = MicroBatch.wire_sizes(rows, width)
                ints, floats = torch.empty(n_ints, dtype=torch.int64), torch.empty(n_floats, dtype=torch.float32)
            dist.broadcast(ints, 0)
            dist.broadcast(floats, 0)
            received.append(micros[i] if self.is_master else MicroBatch.from_wire(ints, floats, rows, width))
        return received, steps

    def _forward_backward(self, micro: MicroBatch) -> None:
        runs = [self.manager.config[idx] for idx in micro.adapter_ids.tolist()]  # each row's run config, read once
        with self.manager.active_adapters(micro.adapter_ids):
            # Each run's rollouts were sampled (and their old log-probabilities taken) at its own
            # temperature; scoring them at 1 would skew every importance ratio of a run at T != 1.
            values = [run.temperature for run in runs]
            device = self.device
            # Dividing [rows, tokens, vocab] logits by 1 changes nothing and costs a pass, forward and backward.
            temperatures = None if all(t == 1.0 for t in values) else torch.tensor(values, device=device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=self._autocast):
                logprobs = token_logprobs(self.model, micro.tokens.to(device), micro.attention.to(device), temperatures)
        # Per row: the sum of its loss tokens' clipped surrogate, each weighted 1 / N_k (run k's
        # loss tokens in its whole step), so a run's gradient does not depend on its packing.
        behaviour = micro.logprobs.to(device)
        proximal, cap = _decoupled_anchor([run.loss for run in runs], logprobs, behaviour)
        surrogate = clipped_surrogate(
            logprobs,
            behaviour,
            micro.advantages.to(device),
            self.config.clip_eps,
            mask=micro.loss_mask.to(device),
            proximal_logp=proximal,
            behav_imp_weight_cap=cap,
        )
        row_losses = surrogate.loss.sum(dim=1) * micro.token_weight.to(device)
        row_losses.sum().backward()
        self.optim.add_loss(row_losses, micro.adapter_ids)

    def _step_runs(self, steps: list[StepDone]) -> list[tuple[int, str, int]]:
        if not steps:
            return []
        idxs = [s.idx for s in steps if not s.dropped]
        started = time.perf_counter()
        if self.world_size > 1:
            self.optim.all_reduce(idxs)
        stats_of = {idx: self.optim.step(idx) for idx in idxs}
        self.times.optimizer_s += time.perf_counter() - started
        stepped = []
        for s in steps:
            run_id = self.manager.idx_2_id[s.idx]
            if s.dropped:
                stats = StepStats(grad_norm=0.0, lr=self.optim.lr(s.idx), loss=0.0)
            else:
                stats = stats_of[s.idx]
            if stats.skipped:
                # The same verdict on every rank (the gradients were all-reduced); rank 0 evicts.
                if self.is_master:
                    self._evict(s.idx, run_id, f"step {s.step}: {stats.skipped}; the optimizer step was skipped")
                continue
            progress = self.manager.record_progress(s.idx, s.tokens, s.samples)
            if progress.step != s.step + 1:
                raise MultiRunError(f"run {run_id}: trained step {s.step} but its progress is at {progress.step}")
            stepped.append((s.idx, run_id, progress.step))
            if self.is_master:
                self.outputs.publish(s, run_id, stats)
        return stepped

    def flush(self) -> None:
        """Wait until every output submitted so far is on disk (or has failed with a warning)."""
        self.outputs.flush()

    def finish(self) -> None:
        """Rank 0: checkpoint every run whose progress is ahead of its last checkpoint, and mark
        the runs at their max_steps finished (unless a marker is already queued)."""
        if self.is_master:
            self.outputs.finish(self._evicted)

    # ---- the loop ----------------------------------------------------------------------------
    def run(self, steps: int | None = None, until_idle_s: float | None = None) -> int:
        """Iterate until stopped; `steps`: iterations that trained something; returns that count."""
        worked = 0
        idle_since = time.monotonic()
        try:
            while True:
                master_stop = steps is not None and worked >= steps
                if until_idle_s is not None and time.monotonic() - idle_since > until_idle_s:
                    master_stop = True
                result = self.iteration(master_stop)
                if result.stop:
                    break
                if result.micro_batches or result.stepped:
                    worked += 1
                    idle_since = time.monotonic()
                else:
                    time.sleep(self.config.poll_interval_s)  # nothing ready: poll the run directories
        finally:
            self.finish()
            self.report_times()
        return worked

    def report_times(self) -> None:
        """Log where the training iterations' time went; rank 0 also writes it to
        `<output_dir>/trainer_times.json` (what benchmarks.multirun_throughput reads)."""
        times = self.times.as_dict()
        log.info(
            "trainer rank %d: %d training iterations in %.2f s: forward+backward %.2f s, optimizer %.2f s, "
            "host work %.2f s (%.0f %%)",
            self.rank,
            times["iterations"],
            times["wall_s"],
            times["forward_backward_s"],
            times["optimizer_s"],
            times["host_s"],
            100 * times["host_fraction"],
        )
        if self.is_master:
            try:
                write_file_atomic(self.config.output_dir / TIMES_FILE, json.dumps(times, indent=1).encode())
            except (OSError, RunDirGoneError) as error:  # a figure, not a result: never fail the stop
                log.warning("%s not written: %s", TIMES_FILE, error)


def _decoupled_anchor(
    losses: list[LossConfig], logprobs: torch.Tensor, behaviour: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The proximal log-probs and per-row caps of AReaL's decoupled objective, for the rows
    (`losses`: each row's run's `loss`) whose run asks for it; (None, None) when none does.

    The proximal policy is the run's adapter as it is before this step. A run takes one
    optimizer step per rollout step, so that is the adapter this forward ran: its log-probs,
    detached, with no second forward. A row of a plain run anchors on its behaviour log-probs
    with no cap, which is plain PPO (its weight is 1)."""
    if not any(loss.decoupled for loss in losses):
        return None, None
    device = logprobs.device
    decoupled = torch.tensor([loss.decoupled for loss in losses], device=device).unsqueeze(1)
    caps = [loss.behav_imp_weight_cap if loss.decoupled else float("inf") for loss in losses]
    proximal = torch.where(decoupled, logprobs.detach().to(behaviour.dtype), behaviour)
    return proximal, torch.tensor(caps, device=device).unsqueeze(1)
