"""MultiLoRALinear: one frozen base layer, one LoRA adapter slot per run, mixed batches in one pass.

Dataflow of one forward, x_N_I with an adapter id per token (``-1`` = base only)::

    x_N_I ──► base_layer ─────────────────────────────────────────────► y_N_O ──► + ──► out
      │                                                                          ▲
      └─► gather rows with id >= 0 in plan.order ─► per-adapter segment           │
          matmuls (x_s @ A_a[:r_a]^T @ B_a[:, :r_a]^T · s_a) ─► index_add (unsort) ┘

Ids already sorted, every token with an adapter (the trainer's micro-batches, packed run by run):
no gather and no index_add: the segments are slices of x, their outputs added to the base output.

The base layer is an ``nn.Linear`` or a GPT-2 style ``transformers.pytorch_utils.Conv1D``
(weight stored [in, out]); its forward is called as is. LoRA A is [r, in] and B is [out, r]
for both, as peft stores them (peft's ``fan_in_fan_out`` only changes how it merges).

The batch plan — which tokens go to which adapter — is the same for every layer of a model,
so the shared ``AdapterBatch`` computes it once per forward of the model (``BatchPlan``):
range check, counts, the stable argsort order of the tokens that have an adapter, the
adapters present, grouped-matmul offsets, and the per-run ranks and scalings read from the
registry. It is computed on the ids' own device (the CPU in the trainer), so a layer never
waits for the GPU: only ``order`` and ``offsets`` are copied to the activations' device, once.

Segments: on CUDA with bf16 activations and aligned shapes, two ``grouped_mm`` calls over all
segments; elsewhere one matmul pair per adapter *present* in the batch (at most
``n_adapters`` iterations, never a loop over tokens). A batch with a single adapter skips the
gather entirely, so K = 1 costs what a plain LoRA layer costs.

Precision: LoRA weights may be kept in another dtype than the base (``lora_dtype``, e.g.
float32 weights and so float32 optimizer state under bf16 activations). The LoRA matmuls run
in the activations' dtype: the weights are cast, differentiably, so gradients reach the
float32 leaves.

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
by mistake is loud). Both are read through the registry at every forward (the plan re-reads
them when their version counter moves), so the manager's updates are seen without
re-registering.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


def grouped_mm_available() -> bool:
    """Whether this torch has ``grouped_mm`` (torch 2.13 runs it on the CPU too, float32 and bf16, with backward)."""
    return _GROUPED_MM is not None


@functools.lru_cache(maxsize=16)
def _cuda_capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' GPT-2 style ``Conv1D`` (y = x @ W + b, W stored [in, out])."""
    # A model holding one has imported transformers.pytorch_utils; looking it up in sys.modules
    # spares models without transformers the import.
    cls = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return isinstance(cls, type) and isinstance(module, cls)


def layer_features(layer: nn.Module) -> tuple[int, int] | None:
    """(in, out) of an ``nn.Linear`` or a Conv1D; None for any other module."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    if is_conv1d(layer):
        n_in, n_out = layer.get_parameter("weight").shape
        return int(n_in), int(n_out)
    return None


def _version(tensor: Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:  # inference-mode tensors keep no version counter
        return -1


def _token_ids(ids: Tensor, x: Tensor) -> Tensor:
    """One id per token of ``x`` (all dims but the last), flat, on the ids' own device."""
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
    return flat.long()


class _RunTable:
    """The registry's scalings and ranks as read for one batch, with what tells whether they changed since."""

    def __init__(self, scaling_factors: Tensor, lora_ranks: Tensor) -> None:
        # Holding the tensors keeps their identity from being reused by another tensor.
        self.sources = (scaling_factors, lora_ranks)
        self.versions = (_version(scaling_factors), _version(lora_ranks))
        self.scales = [float(s) for s in scaling_factors.tolist()]
        self.ranks = [int(r) for r in lora_ranks.tolist()]

    def matches(self, scaling_factors: Tensor, lora_ranks: Tensor) -> bool:
        return (
            self.sources[0] is scaling_factors
            and self.sources[1] is lora_ranks
            and self.versions == (_version(scaling_factors), _version(lora_ranks))
        )


class BatchPlan:
    """How one batch's tokens map to adapters: computed once per model forward, shared by every layer.

    ``single`` is the one id every token has (``NO_ADAPTER`` included) or None for a mixed batch;
    for a mixed batch ``order`` lists the tokens that have an adapter, grouped by adapter in
    ``present`` order (stable), ``present`` holds (adapter, token count) and ``offsets`` the
    int32 cumulative counts that ``grouped_mm`` takes.
    """

    def __init__(self, ids_n: Tensor, device: torch.device, n_adapters: int) -> None:
        self.n_tokens = ids_n.numel()
        self.single: int | None = NO_ADAPTER
        self.present: list[tuple[int, int]] = []
        self.sorted = False
        """Every token has an adapter and the ids never decrease (the trainer packs a micro-batch
        run by run): the segments are slices of the input, so no gather or scatter is needed."""
        self._order: Tensor | None = None
        self._offsets: Tensor | None = None
        self._runs: _RunTable | None = None
        self._factors: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}
        if self.n_tokens == 0:
            return
        # The only host reads of the batch: free when the ids are on the CPU, one wait when on a GPU.
        lo, hi = (int(v) for v in torch.aminmax(ids_n))
        if lo < NO_ADAPTER or hi >= n_adapters:
            raise AdapterError(f"adapter ids must be in [-1, {n_adapters}), got min {lo} max {hi}")
        if lo == hi:
            self.single = lo
            return
        self.single = None
        counts = torch.bincount(ids_n + 1, minlength=hi + 2).tolist()
        self.present = [(a, c) for a, c in enumerate(counts[1:]) if c > 0]
        self.sorted = lo >= 0 and bool((ids_n[1:] >= ids_n[:-1]).all())
        if not self.sorted:
            self._order = torch.argsort(ids_n, stable=True)[counts[0] :].to(device)
        cumulative = list(itertools.accumulate(c for _, c in self.present))
        self._offsets = torch.tensor(cumulative, dtype=torch.int32).to(device)

    @property
    def order(self) -> Tensor:
        if self._order is None:
            raise AdapterError("a batch with a single adapter or sorted ids has no token order")
        return self._order

    @property
    def offsets(self) -> Tensor:
        if self._offsets is None:
            raise AdapterError("a batch with a single adapter has no grouped_mm offsets")
        return self._offsets

    @property
    def adapters(self) -> list[int]:
        return [idx for idx, _ in self.present]

    def runs(self, scaling_factors: Tensor, lora_ranks: Tensor) -> tuple[list[float], list[int]]:
        """Every slot's scaling and rank as Python numbers, read once per batch and again only when changed."""
        if self._runs is None or not self._runs.matches(scaling_factors, lora_ranks):
            self._factors.clear()
            self._runs = _RunTable(scaling_factors, lora_ranks)
        return self._runs.scales, self._runs.ranks

    def grouped_factors(
        self, scaling_factors: Tensor, lora_ranks: Tensor, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """[G, max_rank] per present adapter: its scaling in the columns below its rank, 0 beyond."""
        scales, ranks = self.runs(scaling_factors, lora_ranks)  # clears the factors when they changed
        key = (max_rank, dtype, device)
        factors = self._factors.get(key)
        if factors is None:
            idxs = self.adapters
            columns = torch.arange(max_rank)[None, :]
            mask = columns < torch.tensor([ranks[i] for i in idxs])[:, None]
            factors = (mask * torch.tensor([scales[i] for i in idxs], dtype=torch.float64)[:, None]).to(device, dtype)
            self._factors[key] = factors
        return factors


class AdapterBatch:
    """The adapter id of each row or token for the forward pass in progress.

    One instance is shared by every MultiLoRALinear of a model (the manager owns it when
    there is one), so the ids are set once per batch instead of threaded through the model,
    and the routing plan is computed by the first layer and reused by the others.
    """

    def __init__(self) -> None:
        self.ids: Tensor | None = None
        # One entry: every layer of one model forward asks for the same plan; a new ids tensor,
        # an in-place change of it or another input shape (a decoding step) replaces it.
        self._plan_key: tuple[Any, ...] | None = None
        self._plan_ids: Tensor | None = None
        self._plan: BatchPlan | None = None

    @contextmanager
    def active(self, ids: Tensor) -> Iterator[None]:
        previous, self.ids = self.ids, ids
        self.clear_plan()
        try:
            yield
        finally:
            self.ids = previous
            self.clear_plan()

    def clear_plan(self) -> None:
        self._plan_key = self._plan_ids = self._plan = None

    def plan(self, ids: Tensor, x: Tensor, n_adapters: int) -> BatchPlan:
        """The plan of ``ids`` for an input shaped like ``x``, computed on first use and cached."""
        key = (_version(ids), tuple(x.shape[:-1]), x.device, n_adapters)
        if self._plan is None or self._plan_ids is not ids or self._plan_key != key:
            # Holding the ids keeps their identity from being reused by another tensor.
            self._plan = BatchPlan(_token_ids(ids, x), x.device, n_adapters)
            self._plan_ids, self._plan_key = ids, key
        return self._plan


class LoRARegistry(Protocol):
    """What a MultiLoRALinear needs from the multi-run manager."""

    scaling_factors: Tensor
    lora_ranks: Tensor
    adapter_batch: AdapterBatch

    def register_lora_module(self, module_name: str, module: MultiLoRALinear) -> None: ...


class LocalRegistry:
    """Stand-in used until the module is registered with a manager."""

    def __init__(self, n_adapters: int, rank: int, alpha: float) -> None:
        self.scaling_factors = torch.full((n_adapters,), alpha / rank, dtype=torch.float64)
        self.lora_ranks = torch.full((n_adapters,), rank, dtype=torch.long)
        self.adapter_batch = AdapterBatch()


class MultiLoRALinear(nn.Module):
    """A frozen ``nn.Linear`` or GPT-2 ``Conv1D`` plus ``n_adapters`` LoRA adapters of rank up to ``rank``.

    ``lora_dtype`` is the dtype of the LoRA weights (default: the base weight's); ``dtype`` is
    its older name. The LoRA matmuls run in the activations' dtype whatever it is.
    """

    def __init__(
        self,
        base_layer: nn.Module,
        rank: int,
        n_adapters: int,
        alpha: float = 16.0,
        dropout: float = 0.0,
        dtype: torch.dtype | None = None,
        *,
        lora_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        features = layer_features(base_layer)
        if features is None:
            raise AdapterError(
                f"base_layer: expected nn.Linear or transformers' Conv1D, got {type(base_layer).__name__}"
            )
        if rank < 1 or n_adapters < 1:
            raise AdapterError(f"rank={rank}, n_adapters={n_adapters}: both must be at least 1")
        if dtype is not None and lora_dtype is not None and dtype != lora_dtype:
            raise AdapterError(f"dtype={dtype} and lora_dtype={lora_dtype}: give one (dtype is lora_dtype's old name)")
        self.base_layer = base_layer.requires_grad_(False)
        self.in_features, self.out_features = features
        # peft stores A [r, in] and B [out, r] for Conv1D too; its config must say fan_in_fan_out.
        self.fan_in_fan_out = is_conv1d(base_layer)
        self.rank, self.n_adapters, self.alpha = rank, n_adapters, alpha
        self.dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        weight = base_layer.get_parameter("weight")
        kwargs: dict[str, Any] = {"device": weight.device, "dtype": lora_dtype or dtype or weight.dtype}
        self.lora_A = nn.ParameterList(
            [nn.Parameter(torch.empty(rank, self.in_features, **kwargs)) for _ in range(n_adapters)]
        )
        self.lora_B = nn.ParameterList(
            [nn.Parameter(torch.empty(self.out_features, rank, **kwargs)) for _ in range(n_adapters)]
        )
        self._registry: LoRARegistry | LocalRegistry = LocalRegistry(n_adapters, rank, alpha)
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

    @property
    def lora_dtype(self) -> torch.dtype:
        return self.lora_A[0].dtype

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

    def _checked_rank(self, idx: int, r: int) -> int:
        if not 1 <= r <= self.rank:
            raise AdapterError(f"lora_ranks[{idx}] = {r}: a run's rank must be in [1, {self.rank}]")
        return r

    def _rank_of(self, idx: int) -> int:
        self._check_idx(idx)
        return self._checked_rank(idx, int(self.lora_ranks[idx]))

    # -- forward -------------------------------------------------------------------------------

    def forward(self, x: Tensor, adapter_ids: Tensor | None = None) -> Tensor:
        ids = adapter_ids if adapter_ids is not None else self.adapter_batch.ids
        if ids is None:
            raise AdapterError("no adapter ids: pass adapter_ids or set them with manager.active_adapters(ids)")
        result: Tensor = self.base_layer(x)
        plan = self.adapter_batch.plan(ids, x, self.n_adapters)
        if plan.single == NO_ADAPTER:
            return result
        x_n = x.reshape(-1, self.in_features)
        if plan.single is not None:
            # One adapter for the whole batch: no sort, no gather — the cost of a plain LoRA layer.
            scales, ranks = plan.runs(self.scaling_factors, self.lora_ranks)
            idx = plan.single
            delta = self._segment_delta(x_n, idx, self._checked_rank(idx, ranks[idx]), scales[idx])
            return result + delta.to(result.dtype).view(result.shape)
        x_s = x_n if plan.sorted else x_n.index_select(0, plan.order)
        if self._grouped_enabled(x_s):
            delta_s = self.grouped_delta(x_s, plan)
        else:
            delta_s = self.segment_loop_delta(x_s, plan)
        if plan.sorted:
            return result + delta_s.to(result.dtype).view(result.shape)
        out_n = result.reshape(-1, self.out_features).index_add(0, plan.order, delta_s.to(result.dtype))
        return out_n.view(result.shape)

    def _segment_delta(self, x_m: Tensor, idx: int, r: int, scale: float) -> Tensor:
        a, b = self.lora_A[idx], self.lora_B[idx]
        a, b = (a[:r], b[:, :r]) if r < self.rank else (a, b)
        # No-op casts unless the LoRA weights are kept in a wider dtype than the activations. The
        # scaling goes into B ([out, r]), not onto the output ([tokens, out]): the same product
        # for a fraction of the elementwise work, forward and backward.
        hidden = F.linear(self.dropout(x_m), a.to(x_m.dtype))
        return F.linear(hidden, b.to(x_m.dtype) * scale)

    def segment_loop_delta(self, x_s: Tensor, plan: BatchPlan) -> Tensor:
        """LoRA outputs of the plan's adapter-sorted rows, one matmul pair per adapter present."""
        scales, ranks = plan.runs(self.scaling_factors, self.lora_ranks)
        pieces = []
        for (idx, _), x_m in zip(plan.present, torch.split(x_s, [c for _, c in plan.present]), strict=True):
            pieces.append(self._segment_delta(x_m, idx, self._checked_rank(idx, ranks[idx]), scales[idx]))
        return torch.cat(pieces)

    def grouped_delta(self, x_s: Tensor, plan: BatchPlan) -> Tensor:
        """Same as ``segment_loop_delta`` with two grouped matmuls over all segments."""
        if _GROUPED_MM is None:
            raise AdapterError("this torch has no grouped_mm")
        _, ranks = plan.runs(self.scaling_factors, self.lora_ranks)
        for idx in plan.adapters:
            self._checked_rank(idx, ranks[idx])
        a_g, b_g = self.stacked_weights(plan.adapters)
        # Scalings and ranks folded into B in the LoRA dtype: B's columns past a run's rank are
        # zero, which also zeroes the matching rows of A's gradient, so A needs no mask.
        factors = plan.grouped_factors(self.scaling_factors, self.lora_ranks, self.rank, b_g.dtype, b_g.device)
        b_g = b_g * factors[:, None, :]
        dtype = x_s.dtype
        hidden = _GROUPED_MM(self.dropout(x_s), a_g.to(dtype).transpose(1, 2), offs=plan.offsets)
        return _GROUPED_MM(hidden, b_g.to(dtype).transpose(1, 2), offs=plan.offsets)

    def _grouped_enabled(self, x_s: Tensor) -> bool:
        if self.use_grouped_mm is not None:
            return self.use_grouped_mm
        return (
            _GROUPED_MM is not None
            and x_s.is_cuda
            and x_s.dtype == torch.bfloat16
            and _cuda_capability(x_s.device.index) >= (8, 0)
            # grouped GEMM kernels need 16-byte aligned strides
            and all(d % 8 == 0 for d in (self.rank, self.in_features, self.out_features))
        )

    def extra_repr(self) -> str:
        kind = ", conv1d" if self.fan_in_fan_out else ""
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, n_adapters={self.n_adapters}{kind}"


# The Llama family's targets; kept under this name because callers import it.
