"""MultiLoRALinear forward+backward beside K separate LoRA layers and beside peft's LoRA.

    python -m benchmarks.multilora [--quick] [--device auto|cpu|cuda] [--tokens N] [--dim D] [--rank R]

With CUDA (``--device auto`` finds it) the defaults are the GPU configuration: 8192 tokens,
2048 -> 2048, rank 16, bf16. On the CPU: 4096 tokens, 512 -> 512, rank 16, float32, one
thread. ``--quick`` shrinks either to a smoke run. K = 1, 4 and 16 adapters.

Every variant does forward and backward of one layer over the same N tokens (x requires
grad, as inside a model; the base weight is frozen):

- ``multilora``: one MultiLoRALinear on its automatic path (grouped_mm on CUDA with bf16,
  else the loop), ids shuffled over K adapters (a real mixed batch: gather, segment matmuls,
  unsort). The routing plan is rebuilt at every call, so the layer pays what the first layer
  of a model pays; ``plan_ms`` is that share alone (the other layers reuse the plan).
- ``multilora_loop`` / ``multilora_grouped``: the same layer forced onto one path
  (grouped only where this torch has grouped_mm and the dtype is float32 or bf16).
- ``loop_split``: K separate LoRA layers (frozen base + A + B, peft's maths), each on its own
  N/K tokens, already split (no gather/scatter charged to it). Same FLOPs as ``multilora``:
  it shows what grouping saves in per-call overhead.
- ``loop_masked``: K separate LoRA layers each run over the whole mixed batch, outputs
  selected by mask: what serving a mixed batch with K ordinary LoRA layers costs when the
  tokens are not grouped (K times the base FLOPs).
- ``peft`` (K = 1): a peft ``get_peft_model`` LoRA on the same ``nn.Linear``, its adapter
  kept in the base dtype (``autocast_adapter_dtype=False``) so both run the same precision.

Medians over interleaved repetitions (variants take turns, so a load spike on the shared
machine hits them alike); on CUDA each call is timed between two synchronisations.
``stack_ms`` is the cost of ``torch.stack`` of K slots forward and backward, which only the
grouped path pays.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import Tensor, nn

from rlplex.multirun import MultiLoRALinear
from rlplex.multirun.trainer.lora import BatchPlan, grouped_mm_available

RESULTS = Path("bench_results")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class LoRALayer(nn.Module):
    """One ordinary LoRA layer: frozen base plus A, B; the loop baselines use K of these."""

    def __init__(self, base: nn.Linear, rank: int, scale: float) -> None:
        super().__init__()
        kwargs: dict[str, Any] = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.base = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, **kwargs)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, **kwargs)
        nn.init.normal_(self.lora_B.weight, std=0.02)
        self.scale = scale

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale


def _step_fn(
    forward: Callable[[], Tensor | list[Tensor]], grads: Tensor | list[Tensor], params: list[Tensor]
) -> Callable[[], None]:
    def step() -> None:
        for p in params:
            p.grad = None
        out = forward()
        if isinstance(out, list):
            torch.autograd.backward(out, grads)
        else:
            out.backward(grads)

    return step


def build(
    k: int, n: int, dim: int, rank: int, with_peft: bool, device: torch.device, dtype: torch.dtype
) -> dict[str, Callable[[], None]]:
    torch.manual_seed(k)
    kwargs: dict[str, Any] = {"device": device, "dtype": dtype}
    base = nn.Linear(dim, dim, **kwargs).requires_grad_(False)
    x = torch.randn(n, dim, **kwargs, requires_grad=True)
    grad = torch.randn(n, dim, **kwargs)
    ids = torch.arange(n) % k  # on the CPU, as the trainer keeps them: the plan never waits for the GPU
    ids = ids[torch.randperm(n)]
    variants: dict[str, Callable[[], None]] = {}

    multi = MultiLoRALinear(base, rank=rank, n_adapters=k, alpha=2.0 * rank)
    with torch.no_grad():
        for b in multi.lora_B:
            b.normal_(std=0.02)
    paths: dict[str, bool | None] = {"multilora": None, "multilora_loop": False}
    if grouped_mm_available() and dtype in (torch.float32, torch.bfloat16):
        paths["multilora_grouped"] = True
    for name, grouped in paths.items():

        def forward(grouped: bool | None = grouped) -> Tensor:
            multi.use_grouped_mm = grouped
            multi.adapter_batch.clear_plan()  # charge the routing plan to this layer
            return multi(x, ids)

        variants[name] = _step_fn(forward, grad, [x, *multi.parameters()])

    def plan() -> None:
        BatchPlan(ids, device, k)

    variants["plan"] = plan

    layers = [LoRALayer(base, rank, 2.0) for _ in range(k)]
    loop_params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    xs = [torch.randn(n // k, dim, **kwargs, requires_grad=True) for _ in range(k)]
    gs = [torch.randn(n // k, dim, **kwargs) for _ in range(k)]
    split = lambda: [layer(xk) for layer, xk in zip(layers, xs, strict=True)]  # noqa: E731
    variants["loop_split"] = _step_fn(split, gs, [*xs, *loop_params])

    masks = [(ids == i).to(device)[:, None] for i in range(k)]

    def masked() -> Tensor:
        out = torch.zeros(n, dim, **kwargs)
        for layer, mask in zip(layers, masks, strict=True):
            out = torch.where(mask, layer(x), out)
        return out

    variants["loop_masked"] = _step_fn(masked, grad, [x, *loop_params])

    if with_peft:
        from peft import LoraConfig, get_peft_model

        proj = nn.Linear(dim, dim, **kwargs)
        proj.load_state_dict(base.state_dict())
        holder = nn.Sequential()
        holder.add_module("proj", proj)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["proj"])
        peft_model = get_peft_model(holder, config, autocast_adapter_dtype=False)
        variants["peft"] = _step_fn(lambda: peft_model(x), grad, [x, *peft_model.parameters()])

    stack_grad_a = torch.randn(k, rank, dim, **kwargs)
    stack_grad_b = torch.randn(k, dim, rank, **kwargs)

    def stack() -> None:
        a, b = multi.stacked_weights()
        torch.autograd.backward([a, b], [stack_grad_a, stack_grad_b])

    variants["stack"] = stack
    return variants


def measure(variants: dict[str, Callable[[], None]], reps: int, warmup: int, device: torch.device) -> dict[str, float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            sync()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def _configure(args: argparse.Namespace) -> torch.device:
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = args.device == "cuda"
    if args.quick:
        defaults = (1024, 256, 16, 5) if gpu else (512, 64, 8, 3)
    else:
        defaults = (8192, 2048, 16, 20) if gpu else (4096, 512, 16, 15)
    for field, value in zip(("tokens", "dim", "rank", "reps"), defaults, strict=True):
        if getattr(args, field) is None:
            setattr(args, field, value)
    if args.dtype is None:
        args.dtype = "bf16" if gpu else "fp32"
    return torch.device(args.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (smoke run)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="bf16 on CUDA, fp32 on the CPU")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=None)
    args = parser.parse_args()
    device = _configure(args)
    dtype = DTYPES[args.dtype]
    torch.set_num_threads(args.threads)

    rows = []
    for k in (1, 4, 16):
        variants = build(k, args.tokens, args.dim, args.rank, with_peft=k == 1, device=device, dtype=dtype)
        result = measure(variants, args.reps, warmup=2, device=device)
        rows.append({"K": k, **{f"{name}_ms": round(ms, 3) for name, ms in result.items()}})

    by_k = {row["K"]: row for row in rows}
    goals = {
        "multilora_over_peft_at_K1": by_k[1]["multilora_ms"] / by_k[1]["peft_ms"],
        "loop_split_over_multilora_at_K16": by_k[16]["loop_split_ms"] / by_k[16]["multilora_ms"],
        "loop_masked_over_multilora_at_K16": by_k[16]["loop_masked_ms"] / by_k[16]["multilora_ms"],
    }
    if "multilora_grouped_ms" in by_k[16]:
        goals["multilora_loop_over_grouped_at_K16"] = by_k[16]["multilora_loop_ms"] / by_k[16]["multilora_grouped_ms"]
    shape = f"{args.tokens} tokens, {args.dim}->{args.dim}, rank {args.rank}, {args.dtype}, {device.type}"
    table = Table(title=f"MultiLoRALinear fwd+bwd, {shape} (ms, median)")
    columns = [
        "K",
        "multilora_ms",
        "multilora_loop_ms",
        "multilora_grouped_ms",
        "plan_ms",
        "loop_split_ms",
        "loop_masked_ms",
        "peft_ms",
        "stack_ms",
    ]
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(str(row.get(column, "-")) for column in columns))
    console = Console(width=160)
    console.print(table)
    for name, value in goals.items():
        console.print(f"{name}: {value:.2f}x")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "multilora.json"
    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    payload = {
        "benchmark": "multilora",
        "config": vars(args),
        "machine": {
            "device": device.type,
            "gpu": gpu_name,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "grouped_mm": grouped_mm_available(),
        },
        "rows": rows,
        "ratios": goals,
        "goals": {"multilora_over_peft_at_K1": "<= 1.2", "loop_over_multilora_at_K16": ">= 3"},
    }
    path.write_text(json.dumps(payload, indent=2))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
