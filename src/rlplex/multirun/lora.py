"""MultiLoRALinear: one frozen base layer, one LoRA adapter slot per run, mixed batches in one pass.

Dataflow of one forward, x_N_I with an adapter id per token (``-1`` = base only)::

    x_N_I ──► base_layer ─────────────────────────────────────────────► y_N_O ──► + ──► out
      │                                                                          ▲
      └─► argsort(ids, stable) ─► gather rows with id >= 0 ─► per-adapter segment │
          matmuls (x_s @ A_a[:r_a]^T @ B_a[:, :r_a]^T · s_a) ─► index_add (unsort) ┘

Segments: on CUDA with bf16 and aligned shapes, two ``grouped_mm`` calls over all
segments; elsewhere one matmul pair per adapter *present* in the batch (at most
``n_adapters`` iterations, never a loop over tokens). A batch with a single adapter skips the
sort entirely, so K = 1 costs what a plain LoRA layer costs.

Parameter layout — why a ParameterList of per-adapter Parameters and not stacked tensors:
each run has its own optimizer (Adam state, weight decay, learning-rate schedule, gradient
clipping). With one stacked ``A[n_adapters, r, in]`` Parameter, a per-run optimizer would
have to step a view of a shared leaf, which torch optimizers cannot do, and weight decay or
Adam's moments of one run would touch the others' rows unless every optimizer were rewritten
to mask. Separate leaves give exact isolation for free: run k's optimizer holds exactly
``lora_A[k]`` and ``lora_B[k]``, a slot not in the batch keeps ``grad is None`` and its
optimizer skips it. The loop path indexes the leaves directly (no copy); only the grouped
path stacks the present slots, a copy of G·r·(in+out) elements per call, small beside the
activations (benchmarks/multilora.py: 0.76 ms forward+backward for 16 slots of rank 16 at
512->512, beside 93 ms for the layer on 4096 tokens, CPU, one thread).

Per-run rank is real: run k uses ``A_k[:r_k]`` and ``B_k[:, :r_k]`` with r_k read from
``lora_ranks``; the rows and columns beyond r_k contribute nothing, receive exactly zero
gradient, and are left out of ``adapter_state_dict``. Scaling per run is read from
``scaling_factors`` (the manager sets alpha/rank, and 1e6 for empty slots so that using one
by mistake is loud). Both are read through the registry at every forward, so the manager's
updates are seen without re-registering.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlplex.errors import AdapterError

NO_ADAPTER = -1


def _find_grouped_mm() -> Callable[..., Tensor] | None:
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn if callable(fn) else None


_GROUPED_MM = _find_grouped_mm()


class AdapterBatch:
    """The adapter id of each row or token for the forward pass in progress.

    One instance is shared by every MultiLoRALinear of a model (the manager owns it when
    there is one), so the ids are set once per batch instead of threaded through the model.
    """

    def __init__(self) -> None:
        self.ids: Tensor | None = None

    @contextmanager
    def active(self, ids: Tensor) -> Iterator[None]:
        previous, self.ids = self.ids, ids
        try:
            yield
        finally:
            self.ids = previous


class LoRARegistry(Protocol):
    """What a MultiLoRALinear needs from the multi-run manager."""

    scaling_factors: Tensor
    lora_ranks: Tensor
    adapter_batch: AdapterBatch

    def register_lora_module(self, module_name: str, module: MultiLoRALinear) -> None: ...


class _LocalRegistry:
    """Stand-in used until the module is registered with a manager."""

    def __init__(self, n_adapters: int, rank: int, alpha: float) -> None:
        self.scaling_factors = torch.full((n_adapters,), alpha / rank, dtype=torch.float64)
        self.lora_ranks = torch.full((n_adapters,), rank, dtype=torch.long)
        self.adapter_batch = AdapterBatch()


class MultiLoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus ``n_adapters`` LoRA adapters of rank up to ``rank``."""

    def __init__(
        self,
        base_layer: nn.Linear,
        rank: int,
        n_adapters: int,
        alpha: float = 16.0,
        dropout: float = 0.0,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(base_layer, nn.Linear):
            raise AdapterError(f"base_layer: expected nn.Linear, got {type(base_layer).__name__}")
        if rank < 1 or n_adapters < 1:
            raise AdapterError(f"rank={rank}, n_adapters={n_adapters}: both must be at least 1")
        self.base_layer = base_layer.requires_grad_(False)
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.rank, self.n_adapters, self.alpha = rank, n_adapters, alpha
        self.dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        weight = base_layer.weight
        kwargs: dict[str, Any] = {"device": weight.device, "dtype": dtype or weight.dtype}
        self.lora_A = nn.ParameterList(
            [nn.Parameter(torch.empty(rank, self.in_features, **kwargs)) for _ in range(n_adapters)]
        )
        self.lora_B = nn.ParameterList(
            [nn.Parameter(torch.empty(self.out_features, rank, **kwargs)) for _ in range(n_adapters)]
        )
        self._registry: LoRARegistry | _LocalRegistry = _LocalRegistry(n_adapters, rank, alpha)
        # None = automatic (CUDA + bf16 + aligned shapes); tests force True/False.
        self.use_grouped_mm: bool | None = None
        for idx in range(n_adapters):
            self.reset_adapter(idx)

    # -- registration and per-run access -------------------------------------------------------

    @property
    def scaling_factors(self) -> Tensor:
        return self._registry.scaling_factors

    @property
    def lora_ranks(self) -> Tensor:
        return self._registry.lora_ranks

    @property
    def adapter_batch(self) -> AdapterBatch:
        return self._registry.adapter_batch

    def register_with_runs(self, manager: LoRARegistry, module_name: str) -> None:
        for field in ("scaling_factors", "lora_ranks"):
            value = getattr(manager, field, None)
            if not isinstance(value, Tensor) or value.shape != (self.n_adapters,):
                shape = None if not isinstance(value, Tensor) else tuple(value.shape)
                raise AdapterError(
                    f"{module_name}: manager.{field} must be a tensor of shape ({self.n_adapters},), got {shape}"
                )
        if not isinstance(getattr(manager, "adapter_batch", None), AdapterBatch):
            raise AdapterError(f"{module_name}: manager.adapter_batch must be an AdapterBatch")
        manager.register_lora_module(module_name, self)
        self._registry = manager

    def named_parameters_for_adapter(self, idx: int) -> Iterator[tuple[str, nn.Parameter]]:
        self._check_idx(idx)
        yield "lora_A.weight", self.lora_A[idx]
        yield "lora_B.weight", self.lora_B[idx]

    def adapter_state_dict(self, idx: int) -> dict[str, Tensor]:
        """PEFT-named weights of adapter ``idx``, sliced to its real rank."""
        r = self._rank_of(idx)
        return {
            "lora_A.weight": self.lora_A[idx].detach()[:r].clone(),
            "lora_B.weight": self.lora_B[idx].detach()[:, :r].contiguous().clone(),
        }

    @torch.no_grad()
    def load_adapter_state_dict(self, idx: int, state: dict[str, Tensor]) -> None:
        """Load weights of rank r <= ``rank`` into slot ``idx``; the unused rows are zeroed."""
        a, b = state["lora_A.weight"], state["lora_B.weight"]
        r = a.shape[0]
        if a.shape != (r, self.in_features) or b.shape != (self.out_features, r) or not 1 <= r <= self.rank:
            raise AdapterError(
                f"slot {idx}: adapter shapes A{tuple(a.shape)} B{tuple(b.shape)} do not fit "
                f"in={self.in_features} out={self.out_features} rank<={self.rank}"
            )
        self.lora_A[idx].zero_()[:r].copy_(a)
        self.lora_B[idx].zero_()[:, :r].copy_(b)

    @torch.no_grad()
    def reset_adapter(self, idx: int) -> None:
        """Fresh adapter as peft initialises one: A kaiming-uniform, B zeros (output unchanged)."""
        self._check_idx(idx)
        nn.init.kaiming_uniform_(self.lora_A[idx], a=math.sqrt(5))
        nn.init.zeros_(self.lora_B[idx])
        # A reused slot must not inherit the previous run's gradient.
        self.lora_A[idx].grad = None
        self.lora_B[idx].grad = None

    def stacked_weights(self, idxs: list[int] | None = None) -> tuple[Tensor, Tensor]:
        """A [G, rank, in] and B [G, out, rank] of the given slots (all by default); differentiable."""
        idxs = list(range(self.n_adapters)) if idxs is None else idxs
        return torch.stack([self.lora_A[i] for i in idxs]), torch.stack([self.lora_B[i] for i in idxs])

    def _check_idx(self, idx: int) -> None:
        if not 0 <= idx < self.n_adapters:
            raise AdapterError(f"adapter index {idx} out of range [0, {self.n_adapters})")

    def _rank_of(self, idx: int) -> int:
        self._check_idx(idx)
        r = int(self.lora_ranks[idx])
        if not 1 <= r <= self.rank:
            raise AdapterError(f"lora_ranks[{idx}] = {r}: a run's rank must be in [1, {self.rank}]")
        return r

    # -- forward -------------------------------------------------------------------------------

    def forward(self, x: Tensor, adapter_ids: Tensor | None = None) -> Tensor:
        ids = adapter_ids if adapter_ids is not None else self.adapter_batch.ids
        if ids is None:
            raise AdapterError("no adapter ids: pass adapter_ids or set them with manager.active_adapters(ids)")
        result: Tensor = self.base_layer(x)
        ids_n = self._token_ids(ids, x)
        if ids_n.numel() == 0:
            return result
        lo, hi = (int(v) for v in torch.aminmax(ids_n))
        if lo < NO_ADAPTER or hi >= self.n_adapters:
            raise AdapterError(f"adapter ids must be in [-1, {self.n_adapters}), got min {lo} max {hi}")
        x_n = x.reshape(-1, self.in_features)
        if lo == hi:
            # One adapter for the whole batch: no sort, no gather — the cost of a plain LoRA layer.
            if lo == NO_ADAPTER:
                return result
            delta = self._segment_delta(x_n, lo, self._rank_of(lo), float(self.scaling_factors[lo]))
            return result + delta.to(result.dtype).view(result.shape)
        counts = torch.bincount(ids_n + 1, minlength=self.n_adapters + 1).tolist()
        present = [(a, c) for a, c in enumerate(counts[1:]) if c > 0]
        order = torch.argsort(ids_n, stable=True)[counts[0] :]  # tokens with an adapter, grouped
        x_s = x_n.index_select(0, order)
        if self._grouped_enabled(x_s):
            delta_s = self.grouped_delta(x_s, present)
        else:
            delta_s = self.segment_loop_delta(x_s, present)
        out_n = result.reshape(-1, self.out_features).index_add(0, order, delta_s.to(result.dtype))
        return out_n.view(result.shape)

    def _token_ids(self, ids: Tensor, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        if ids.shape == lead:
            flat = ids.reshape(-1)
        elif x.dim() == 3 and ids.shape == lead[:1]:
            flat = ids[:, None].expand(lead).reshape(-1)  # one id per row
        else:
            raise AdapterError(
                f"adapter ids of shape {tuple(ids.shape)} do not fit input {tuple(x.shape)}: "
                "give one id per token or one per row"
            )
        return flat.to(device=x.device, dtype=torch.long)

    def _segment_delta(self, x_m: Tensor, idx: int, r: int, scale: float) -> Tensor:
        a, b = self.lora_A[idx], self.lora_B[idx]
        hidden = F.linear(self.dropout(x_m.to(a.dtype)), a[:r] if r < self.rank else a)
        return F.linear(hidden, b[:, :r] if r < self.rank else b) * scale

    def segment_loop_delta(self, x_s: Tensor, present: list[tuple[int, int]]) -> Tensor:
        """LoRA outputs of adapter-sorted rows, one matmul pair per adapter present."""
        scales = self.scaling_factors.tolist()
        pieces = []
        for (idx, _), x_m in zip(present, torch.split(x_s, [c for _, c in present]), strict=True):
            pieces.append(self._segment_delta(x_m, idx, self._rank_of(idx), float(scales[idx])))
        return torch.cat(pieces)

    def grouped_delta(self, x_s: Tensor, present: list[tuple[int, int]]) -> Tensor:
        """Same as ``segment_loop_delta`` with two grouped matmuls over all segments."""
        if _GROUPED_MM is None:
            raise AdapterError("this torch has no grouped_mm")
        idxs = [idx for idx, _ in present]
        a_g, b_g = self.stacked_weights(idxs)
        ranks = torch.tensor([self._rank_of(i) for i in idxs], device=a_g.device)
        mask_g_r = (torch.arange(self.rank, device=a_g.device)[None, :] < ranks[:, None]).to(a_g.dtype)
        scale_g = self.scaling_factors[idxs].to(device=a_g.device, dtype=a_g.dtype)
        a_g = a_g * mask_g_r[:, :, None]
        b_g = b_g * (mask_g_r * scale_g[:, None])[:, None, :]
        offs = torch.tensor([c for _, c in present], device=x_s.device).cumsum(0).to(torch.int32)
        hidden = _GROUPED_MM(self.dropout(x_s.to(a_g.dtype)), a_g.transpose(1, 2), offs=offs)
        return _GROUPED_MM(hidden, b_g.transpose(1, 2), offs=offs)

    def _grouped_enabled(self, x_s: Tensor) -> bool:
        if self.use_grouped_mm is not None:
            return self.use_grouped_mm
        a = self.lora_A[0]
        return (
            _GROUPED_MM is not None
            and x_s.is_cuda
            and a.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x_s.device) >= (8, 0)
            # grouped GEMM kernels need 16-byte aligned strides
            and all(d % 8 == 0 for d in (self.rank, self.in_features, self.out_features))
        )

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, n_adapters={self.n_adapters}"


DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class MultiLoRAModules:
    """The MultiLoRALinear modules that ``apply_multi_lora`` put into a model, by module name."""

    def __init__(self, modules: dict[str, MultiLoRALinear], registry: LoRARegistry | _LocalRegistry) -> None:
        self.modules = modules
        self.registry = registry

    @property
    def adapter_batch(self) -> AdapterBatch:
        return self.registry.adapter_batch

    @property
    def scaling_factors(self) -> Tensor:
        """Shared by every module: write ``scaling_factors[k] = alpha_k / rank_k`` once for all."""
        return self.registry.scaling_factors

    @property
    def lora_ranks(self) -> Tensor:
        return self.registry.lora_ranks

    def active_adapters(self, ids: Tensor) -> AbstractContextManager[None]:
        return self.adapter_batch.active(ids)

    def named_parameters_for_adapter(self, idx: int) -> Iterator[tuple[str, nn.Parameter]]:
        for name, module in self.modules.items():
            for local, param in module.named_parameters_for_adapter(idx):
                yield f"{name}.{local}", param

    def adapter_state_dict(self, idx: int) -> dict[str, Tensor]:
        """Keys are the model's module names plus ``.lora_A.weight`` / ``.lora_B.weight``."""
        return {
            f"{name}.{local}": tensor
            for name, module in self.modules.items()
            for local, tensor in module.adapter_state_dict(idx).items()
        }

    def reset_adapter(self, idx: int) -> None:
        for module in self.modules.values():
            module.reset_adapter(idx)


def apply_multi_lora(
    model: nn.Module,
    target_modules: tuple[str, ...] | list[str] = DEFAULT_TARGET_MODULES,
    rank: int = 8,
    n_adapters: int | None = None,
    alpha: float = 16.0,
    dropout: float = 0.0,
    manager: LoRARegistry | None = None,
) -> MultiLoRAModules:
    """Freeze ``model`` and replace each ``nn.Linear`` whose name ends in a target with a MultiLoRALinear.

    Names match as in peft: the last component equals a target (``q_proj`` matches
    ``model.layers.0.self_attn.q_proj``). With a manager, ``n_adapters`` defaults to its slot
    count and every module registers under its module name.
    """
    if n_adapters is None:
        if manager is None:
            raise AdapterError("apply_multi_lora: give n_adapters or a manager")
        n_adapters = int(manager.scaling_factors.shape[0])
    model.requires_grad_(False)
    targets = set(target_modules)
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    ]
    if not found:
        raise AdapterError(f"apply_multi_lora: no nn.Linear module matches target_modules={sorted(targets)}")
    # Without a manager the modules share one local registry, so ranks, scalings and ids are set once.
    registry: LoRARegistry | _LocalRegistry = manager or _LocalRegistry(n_adapters, rank, alpha)
    modules: dict[str, MultiLoRALinear] = {}
    for name, base in found:
        lora = MultiLoRALinear(base, rank=rank, n_adapters=n_adapters, alpha=alpha, dropout=dropout)
        if manager is not None:
            lora.register_with_runs(manager, name)
        else:
            lora._registry = registry
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, lora)
        modules[name] = lora
    return MultiLoRAModules(modules, registry)
