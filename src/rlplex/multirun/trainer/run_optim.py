"""Per-run optimisation: optimizer, LR schedule, gradient clipping and loss, isolated per run.

A run's optimizer (AdamW over exactly its adapter's leaves) and its schedule (linear decay
over the run's own `max_steps`) are created in a creation hook and dropped in a deletion
hook, on every rank. A run that resumes loads its adapter, optimizer and scheduler from the
stable checkpoint rank 0 chose for it, then, when rank 0 found a newer broadcast adapter, the
adapter from that one and the schedule moved on to its step (see `checkpoint.choose_resume`);
both are keyed by run id, not slot, so they load into whatever slot the run has now. Clipping
is over the run's own gradients only.
With several ranks, the gradients of the runs that step are summed over the group in one
flat all-reduce, in the order rank 0 decided, before clipping.

The trainer's loss (`rl_math.clipped_surrogate` per token, summed per row and weighted by
`1 / N_k`, N_k: loss tokens of run k's whole step, so that a run's gradient is the same
whether it is packed alone or beside others) lands here as per-row sums (`add_loss`).
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from rlplex.errors import AdapterError, CheckpointError
from rlplex.multirun.rundir.checkpoint import load_checkpoint
from rlplex.multirun.rundir.peft_export import read_peft_adapter
from rlplex.multirun.trainer.lora import MultiLoRALinear
from rlplex.multirun.trainer.manager import MultiRunManager

log = logging.getLogger(__name__)

MIN_LR_FRACTION = 0.1


def linear_decay(max_steps: int, min_fraction: float = MIN_LR_FRACTION) -> Callable[[int], float]:
    """The run's LR factor: from 1 down to `min_fraction` over the run's own `max_steps`."""

    def factor(step: int) -> float:
        return 1.0 - (1.0 - min_fraction) * min(step, max_steps) / max_steps

    return factor


@dataclass
class StepStats:
    grad_norm: float
    lr: float
    loss: float
    skipped: str = ""
    """Why the optimizer step was not taken (a non-finite loss or gradient); empty when it was."""


class RunOptimizers:
    """The optimizers and schedules of every active run; registers its hooks on `manager`."""

    def __init__(self, manager: MultiRunManager) -> None:
        self.manager = manager
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self.schedulers: dict[int, LambdaLR] = {}
        self.params: dict[int, list[torch.nn.Parameter]] = {}
        self.run_ids: dict[int, str] = {}
        self.resume_failures: dict[int, str] = {}
        """Slots whose checkpoint could not be loaded (the same on every rank); rank 0 evicts them."""
        self.loss_sums = torch.zeros(manager.max_runs, dtype=torch.float64)
        manager.register_creation_hook(self.create, name="rlplex.multirun.trainer.run_optim.create")
        manager.register_deletion_hook(self.drop, name="rlplex.multirun.trainer.run_optim.drop")

    def create(self, idx: int, run_id: str) -> None:
        config = self.manager.config[idx]
        params = [p for _, p in self.manager.get_named_parameters_for_run(idx)]
        if not all(isinstance(p, torch.nn.Parameter) for p in params):
            raise AdapterError(f"slot {idx}: the registered LoRA modules must hand out leaf parameters")
        for p in params:
            p.grad = None
        # Fused, as every rlplex optimizer: one kernel for the step, not a loop over a run's many
        # small LoRA tensors (0.16 ms against foreach's 0.59 ms for 28 of them, CPU).
        optimizer = torch.optim.AdamW(params, lr=config.optim.lr, weight_decay=config.optim.weight_decay, fused=True)
        scheduler = LambdaLR(optimizer, linear_decay(config.max_steps))
        self.optimizers[idx], self.schedulers[idx] = optimizer, scheduler
        self.params[idx] = params  # type: ignore[assignment]
        if params:  # the loss sums live beside the adapters: no host sync a micro-batch on a GPU
            self.loss_sums = self.loss_sums.to(params[0].device)
        self.run_ids[idx] = run_id
        self.loss_sums[idx] = 0.0
        self.resume_failures.pop(idx, None)
        path = self.manager.resume_checkpoint_path(idx)
        adapter_path = self.manager.resume_adapter_path(idx)
        if path is None:
            self._init_adapter(idx, run_id, config.seed)
        try:
            if path is not None:
                self._load(idx, path)
            if adapter_path is not None:
                source = self.manager.run_dir(run_id)
                self._load_adapter(idx, read_peft_adapter(adapter_path, within=source.root), adapter_path)
                self._advance_schedule(idx, self.manager.progress[idx].step)
        except (CheckpointError, AdapterError, KeyError, ValueError, RuntimeError) as error:
            self.manager.reset_run_parameters(idx)
            self.resume_failures[idx] = f"cannot resume from {adapter_path or path}: {error}"
            log.error("run %s (slot %d): %s", run_id, idx, self.resume_failures[idx])

    @torch.no_grad()
    def _init_adapter(self, idx: int, run_id: str, seed: int) -> None:
        """A fresh adapter drawn from the run's own seed and id, not from the trainer's RNG:
        the same run starts from the same weights whatever slot, trainer or rank it lands on."""
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{run_id}".encode()))
        for name in sorted(self.manager.lora_modules):
            for key, param in self.manager.lora_modules[name].named_parameters_for_adapter(idx):
                if key.startswith("lora_A"):
                    bound = 1.0 / math.sqrt(param.shape[1])  # kaiming-uniform with a = sqrt(5), as peft
                    values = torch.empty(param.shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
                    param.copy_(values)
                else:
                    param.zero_()

    def _load(self, idx: int, path: Path) -> None:
        checkpoint = load_checkpoint(path)
        self._load_adapter(idx, checkpoint.adapter, path)
        self.optimizers[idx].load_state_dict(checkpoint.optimizer)
        self.schedulers[idx].load_state_dict(checkpoint.scheduler)

    def _load_adapter(self, idx: int, adapter: dict[str, torch.Tensor], path: Path) -> None:
        for name, module in self.manager.lora_modules.items():
            if not isinstance(module, MultiLoRALinear):
                raise AdapterError(f"{name}: only MultiLoRALinear modules can load a checkpoint")
            keys = (f"{name}.lora_A.weight", f"{name}.lora_B.weight")
            missing = [k for k in keys if k not in adapter]
            if missing:
                raise CheckpointError(f"{path}: adapter lacks {missing}")
            if not all(bool(torch.isfinite(adapter[k]).all()) for k in keys):
                raise CheckpointError(f"{path}: adapter {name} holds NaN or infinite values")
            module.load_adapter_state_dict(idx, {k.rsplit(".", 2)[-2] + ".weight": adapter[k] for k in keys})

    def _advance_schedule(self, idx: int, step: int) -> None:
        """Set the run's LR schedule at `step` (the adapter is newer than the optimizer's checkpoint)."""
        scheduler, optimizer = self.schedulers[idx], self.optimizers[idx]
        scheduler.last_epoch = step
        for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
            group["lr"] = base * factor(step)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]

    def lr(self, idx: int) -> float:
        return float(self.optimizers[idx].param_groups[0]["lr"])

    def drop(self, idx: int, run_id: str) -> None:
        for p in self.params.pop(idx, []):
            p.grad = None  # a partly accumulated step of a deleted run must not leak into the next
        self.optimizers.pop(idx, None)
        self.schedulers.pop(idx, None)
        self.run_ids.pop(idx, None)
        self.resume_failures.pop(idx, None)
        self.loss_sums[idx] = 0.0

    def add_loss(self, row_losses: torch.Tensor, adapter_ids: torch.Tensor) -> None:
        self.loss_sums.index_add_(0, adapter_ids.to(row_losses.device), row_losses.detach().to(torch.float64))

    def all_reduce(self, idxs: list[int]) -> None:
        """Sum the gradients (and loss sums) of the runs in `idxs` over the default group."""
        params = [p for idx in idxs for p in self.params[idx]]
        pieces = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
        flat = torch.cat([*pieces, self.loss_sums[idxs].to(pieces[0].dtype if pieces else torch.float32)])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n
        self.loss_sums[idxs] = flat[offset:].to(torch.float64)

    def step(self, idx: int) -> StepStats:
        """Clip this run's gradients, step its optimizer and schedule, and clear its gradients."""
        config = self.manager.config[idx]
        params = self.params[idx]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norm = float(torch.nn.utils.clip_grad_norm_(params, config.optim.max_grad_norm))
        lr = self.lr(idx)
        loss = float(self.loss_sums[idx])
        self.loss_sums[idx] = 0.0
        skipped = ""
        if not (math.isfinite(loss) and math.isfinite(norm)):
            # One NaN step would make the adapter NaN for good: never apply it.
            skipped = f"loss {loss} / gradient norm {norm} is not finite"
        else:
            self.optimizers[idx].step()
            self.schedulers[idx].step()
        self.optimizers[idx].zero_grad(set_to_none=True)
        return StepStats(grad_norm=norm, lr=lr, loss=loss, skipped=skipped)
