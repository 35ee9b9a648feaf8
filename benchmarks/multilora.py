"""MultiLoRALinear forward+backward beside K separate LoRA layers and beside peft's LoRA.

    python -m benchmarks.multilora [--quick] [--tokens 4096] [--dim 512] [--rank 16]

Every variant does forward and backward of one layer over the same N tokens (x requires
grad, as inside a model; the base weight is frozen):

- ``multilora``: one MultiLoRALinear, ids shuffled over K adapters (a real mixed batch:
  sort, segment matmuls, unsort).
- ``loop_split``: K separate LoRA layers (frozen base + A + B, peft's maths), each on its own
  N/K tokens, already split (no gather/scatter charged to it). Same FLOPs as ``multilora``:
  it shows what grouping saves in per-call overhead.
- ``loop_masked``: K separate LoRA layers each run over the whole mixed batch, outputs
  selected by mask: what serving a mixed batch with K ordinary LoRA layers costs when the
  tokens are not grouped (K times the base FLOPs).
- ``peft`` (K = 1): a peft ``get_peft_model`` LoRA on the same ``nn.Linear``.

Medians over interleaved repetitions (variants take turns, so a load spike on the shared
machine hits them alike). ``stack_ms`` is the cost of ``torch.stack`` of K slots forward and
backward, which only the CUDA grouped_mm path pays.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch import Tensor, nn

from rlplex.multirun import MultiLoRALinear

RESULTS = Path("bench_results")


class LoRALayer(nn.Module):
    """One ordinary LoRA layer: frozen base plus A, B; the loop baselines use K of these."""

    def __init__(self, base: nn.Linear, rank: int, scale: float) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
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


def build(k: int, n: int, dim: int, rank: int, with_peft: bool) -> dict[str, Callable[[], None]]:
    torch.manual_seed(k)
    base = nn.Linear(dim, dim).requires_grad_(False)
    x = torch.randn(n, dim, requires_grad=True)
    grad = torch.randn(n, dim)
    ids = torch.arange(n) % k
    ids = ids[torch.randperm(n)]
    variants: dict[str, Callable[[], None]] = {}

    multi = MultiLoRALinear(base, rank=rank, n_adapters=k, alpha=2.0 * rank)
    with torch.no_grad():
        for b in multi.lora_B:
            b.normal_(std=0.02)
    variants["multilora"] = _step_fn(lambda: multi(x, ids), grad, [x, *multi.parameters()])

    layers = [LoRALayer(base, rank, 2.0) for _ in range(k)]
    loop_params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    xs = [torch.randn(n // k, dim, requires_grad=True) for _ in range(k)]
    gs = [torch.randn(n // k, dim) for _ in range(k)]
    split = lambda: [layer(xk) for layer, xk in zip(layers, xs, strict=True)]  # noqa: E731
    variants["loop_split"] = _step_fn(split, gs, [*xs, *loop_params])

    masks = [(ids == i)[:, None] for i in range(k)]

    def masked() -> Tensor:
        out = torch.zeros(n, dim)
        for layer, mask in zip(layers, masks, strict=True):
            out = torch.where(mask, layer(x), out)
        return out

    variants["loop_masked"] = _step_fn(masked, grad, [x, *loop_params])

    if with_peft:
        from peft import LoraConfig, get_peft_model

        holder = nn.Sequential()
        holder.add_module("proj", nn.Linear(dim, dim))
        holder.proj.load_state_dict(base.state_dict())
        peft_model = get_peft_model(holder, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["proj"]))
        variants["peft"] = _step_fn(lambda: peft_model(x), grad, [x, *peft_model.parameters()])

    stack_grad_a, stack_grad_b = torch.randn(k, rank, dim), torch.randn(k, dim, rank)

    def stack() -> None:
        a, b = multi.stacked_weights()
        torch.autograd.backward([a, b], [stack_grad_a, stack_grad_b])

    variants["stack"] = stack
    return variants


def measure(variants: dict[str, Callable[[], None]], reps: int, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (smoke run)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.dim, args.rank, args.reps = 512, 64, 8, 3
    torch.set_num_threads(args.threads)

    rows = []
    for k in (1, 4, 16):
        result = measure(build(k, args.tokens, args.dim, args.rank, with_peft=k == 1), args.reps, warmup=2)
        rows.append({"K": k, **{f"{name}_ms": round(ms, 3) for name, ms in result.items()}})

    by_k = {row["K"]: row for row in rows}
    goals = {
        "multilora_over_peft_at_K1": by_k[1]["multilora_ms"] / by_k[1]["peft_ms"],
        "loop_split_over_multilora_at_K16": by_k[16]["loop_split_ms"] / by_k[16]["multilora_ms"],
        "loop_masked_over_multilora_at_K16": by_k[16]["loop_masked_ms"] / by_k[16]["multilora_ms"],
    }
    shape = f"{args.tokens} tokens, {args.dim}->{args.dim}, rank {args.rank}"
    table = Table(title=f"MultiLoRALinear fwd+bwd, {shape} (ms, median)")
    columns = ["K", "multilora_ms", "loop_split_ms", "loop_masked_ms", "peft_ms", "stack_ms"]
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(str(row.get(column, "-")) for column in columns))
    console = Console()
    console.print(table)
    for name, value in goals.items():
        console.print(f"{name}: {value:.2f}x")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "multilora.json"
    payload = {
        "benchmark": "multilora",
        "config": vars(args),
        "machine": {"device": "cpu", "torch": torch.__version__, "python": platform.python_version()},
        "rows": rows,
        "ratios": goals,
        "goals": {"multilora_over_peft_at_K1": "<= 1.2", "loop_over_multilora_at_K16": ">= 3"},
    }
    path.write_text(json.dumps(payload, indent=2))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
