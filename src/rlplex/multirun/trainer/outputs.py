"""Rank 0's outputs of each run, written by the background writer in submission order:
`broadcast/step_N` (a PEFT adapter with the trainer's counters), `checkpoints/step_N`, the
progress row of each step, and `control/finished.txt` behind a run's final outputs.

Each job takes copies of the state it writes when it is queued, and writes by run id, so a
slot given to another run meanwhile cannot receive it; retention prunes older steps after each
write. `finish` checkpoints every run whose progress is ahead of its last checkpoint (the
trainer's graceful stop).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass

from rlplex.errors import AdapterError, MultiRunError, RunDirGoneError
from rlplex.multirun.rundir.checkpoint import RunProgress, save_checkpoint
from rlplex.multirun.rundir.peft_export import write_peft_adapter
from rlplex.multirun.rundir.retention import prune_steps
from rlplex.multirun.trainer.config import TrainerConfig
from rlplex.multirun.trainer.log import BackgroundWriter, ProgressLog, RunFinisher
from rlplex.multirun.trainer.manager import MultiRunManager
from rlplex.multirun.trainer.output_retry import OutputKind, OutputRetries
from rlplex.multirun.trainer.run_optim import RunOptimizers, StepStats

log = logging.getLogger(__name__)


@dataclass
class StepDone:
    idx: int
    step: int
    tokens: int
    samples: int
    dropped: int = 0  # 1: the rollouts were too stale; the step counts as done with no update
    reward_mean: float = 0.0
    policy_step: int = 0


class RunOutputs:
    def __init__(
        self, config: TrainerConfig, manager: MultiRunManager, optim: RunOptimizers, fan_in_fan_out: bool
    ) -> None:
        self.config, self.manager, self.optim = config, manager, optim
        self.fan_in_fan_out = fan_in_fan_out  # GPT-2's Conv1D layers store their weight transposed
        self.writer = BackgroundWriter()
        self.finisher = RunFinisher(self.writer, config.output_retry_s)
        self.retries = OutputRetries(config.output_retry_s, config.max_output_failures)
        self.progress_log = ProgressLog()
        self.checkpoint_due: dict[str, int] = {}
        """The newest checkpoint step submitted per run id."""

    def forget(self, run_id: str) -> None:
        self.checkpoint_due.pop(run_id, None)
        self.finisher.forget(run_id)
        self.retries.forget(run_id)

    def _failed(self, run_id: str, kind: OutputKind, step: int, error: str) -> None:
        """Writer thread: a run's output not written; tried again later (`retry_failed`)."""
        log.warning(
            "run %s: %s step %d not written: %s; tried again in %g s", run_id, kind, step, error, self.retries.retry_s
        )
        self.retries.report(run_id, kind, step, error)

    def retry_failed(self, now: float | None = None) -> list[tuple[int, str, str]]:
        """Rank 0: queue again the outputs that failed and whose time has come, at each run's
        current step; returns (slot, run id, reason) of the runs whose outputs keep failing."""
        plan = self.retries.plan(time.monotonic() if now is None else now)
        for run_id, redo_checkpoint in plan.retry:
            idx = self.manager.id_2_idx.get(run_id)
            if idx is None:  # gone meanwhile
                self.retries.forget(run_id)
                continue
            step = self.manager.progress[idx].step
            if redo_checkpoint:
                self.checkpoint(idx, run_id, step)
            self.broadcast(idx, run_id, step)
        return [
            (self.manager.id_2_idx[run_id], run_id, reason)
            for run_id, reason in plan.give_up
            if run_id in self.manager.id_2_idx
        ]

    def broadcast(self, idx: int, run_id: str, step: int) -> None:
        lora_cfg = self.manager.config[idx].model.lora
        run = self.manager.run_dir(run_id)
        path = run.broadcast_step(step)
        progress = self.manager.progress[idx].state_dict()
        if progress["step"] != step:
            raise MultiRunError(f"run {run_id}: broadcast of step {step} asked at progress step {progress['step']}")
        state = self.manager.get_state_dict_for_run(idx)  # a copy: the next step cannot change it
        targets = {name.rsplit(".", 1)[-1] for name in self.manager.lora_modules}
        base_name = self.config.model.resolved().name  # peft and vLLM load the adapter over this
        fan_in_fan_out = self.fan_in_fan_out
        retention = self.config.retention

        def job() -> None:
            withheld = self.retries.checkpoint_failed.get(run_id)
            if withheld is not None:
                self._failed(run_id, "broadcast", step, f"withheld until a checkpoint is written ({withheld})")
                return
            try:
                run.ensure_dir("broadcast")  # refused if the run was deleted or replaced meanwhile
                write_peft_adapter(
                    path,
                    state,
                    base_name,
                    lora_cfg.rank,
                    lora_cfg.alpha,
                    targets,
                    fan_in_fan_out=fan_in_fan_out,
                    progress=progress,
                )
                run.check_identity()
            except RunDirGoneError as error:
                log.warning("run %s: broadcast step %d not written: %s", run_id, step, error)
                return
            except (AdapterError, MultiRunError, OSError) as error:
                self._failed(run_id, "broadcast", step, str(error))
                return
            self.retries.report(run_id, "broadcast", step, None)
            prune_steps(run.broadcast, retention.broadcast, protect={step})
            prune_steps(run.rollouts, retention.rollouts, below=step)  # rollouts below `step` are trained

        self.writer.submit(job)

    def checkpoint(self, idx: int, run_id: str, step: int) -> None:
        # Copies taken now; the job writes by run id, so a slot reused meanwhile cannot receive it.
        adapter = self.manager.get_state_dict_for_run(idx)
        optimizer = copy.deepcopy(self.optim.optimizers[idx].state_dict())
        scheduler = copy.deepcopy(self.optim.schedulers[idx].state_dict())
        progress = RunProgress.from_state_dict(self.manager.progress[idx].state_dict())
        run = self.manager.run_dir(run_id)
        keep = self.config.retention.checkpoints

        def job() -> None:
            try:
                save_checkpoint(run, step, adapter, optimizer, scheduler, progress)
                run.check_identity()
            except RunDirGoneError as error:
                log.warning("run %s: checkpoint step %d not written: %s", run_id, step, error)
                return
            except (MultiRunError, OSError) as error:  # CheckpointError among them
                self._failed(run_id, "checkpoint", step, str(error))
                return
            self.retries.report(run_id, "checkpoint", step, None)
            prune_steps(run.checkpoints, keep, protect={step})

        self.checkpoint_due[run_id] = step
        self.writer.submit(job)

    def mark_finished(self, idx: int, run_id: str, step: int, now: float | None = None) -> None:
        """Rank 0: queue `control/finished.txt` of a run at its max_steps behind its final outputs.

        The step's checkpoint and broadcast were queued when the run stepped (or, for a run
        resumed at its last step, when it was created); a checkpoint not yet queued is queued
        first, and outputs that failed are written again by `retry_failed`. `now=inf` ignores
        the wait before a retry (the trainer is stopping).
        """
        if not self.finisher.due(run_id, now):
            return
        if self.checkpoint_due.get(run_id, -1) < step:
            self.checkpoint(idx, run_id, step)
        self.finisher.submit(self.manager.run_dir(run_id), step)

    def flush(self) -> None:
        """Wait until every output submitted so far is on disk (or has failed with a warning)."""
        self.writer.flush()

    def publish(self, done: StepDone, run_id: str, stats: StepStats) -> None:
        step = done.step + 1
        max_steps = self.manager.config[done.idx].max_steps
        # Checkpoint before broadcast (one writer thread keeps the order): a trainer killed in
        # between leaves no published step that its resume would train a second time.
        if step % self.config.checkpoint_every == 0 or step >= max_steps:
            self.checkpoint(done.idx, run_id, step)
        self.broadcast(done.idx, run_id, step)
        progress = self.manager.progress[done.idx]
        row = {
            "step": step,
            "total_tokens": progress.total_tokens,
            "total_samples": progress.total_samples,
            "loss": stats.loss,
            "reward_mean": done.reward_mean,
            "policy_step": done.policy_step,
            "stale_dropped": done.dropped,  # 1: this step's rollouts were too stale to train
            "grad_norm": stats.grad_norm,
            "lr": stats.lr,
            "slot": done.idx,
            # Wall-clock time lets a reader (the live view) compute the trainer's throughput.
            "time": round(time.time(), 3),
        }
        run = self.manager.run_dir(run_id)
        self.writer.submit(lambda: self.progress_log.append(run, row))
        log.info(
            "run %s (slot %d): step %d/%d loss %.4f reward %.3f grad_norm %.3f lr %.2e tokens %d",
            run_id,
            done.idx,
            step,
            max_steps,
            stats.loss,
            done.reward_mean,
            stats.grad_norm,
            stats.lr,
            progress.total_tokens,
        )

    def finish(self, evicted: set[str]) -> None:
        """Rank 0: checkpoint every run whose progress is ahead of its last checkpoint, and mark
        the runs at their max_steps finished (unless a marker is already queued)."""
        self.retry_failed(now=float("inf"))  # a last try of what failed; the next trainer judges the rest
        for idx, run_id in sorted(self.manager.idx_2_id.items()):
            step = self.manager.progress[idx].step
            if run_id in evicted or idx in self.optim.resume_failures:
                continue
            if step >= self.manager.config[idx].max_steps:
                self.mark_finished(idx, run_id, step, now=float("inf"))
            elif step > self.checkpoint_due.get(run_id, -1) and step > 0:
                self.checkpoint(idx, run_id, step)
        self.flush()
