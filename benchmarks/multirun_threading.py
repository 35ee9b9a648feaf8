"""How well one trainer's intra-op threads use the cores, beside one single-run trainer per core.

    python -m benchmarks.multirun_threading [--quick] [--model tiny|smollm2|NAME] [--runs 4] [--rows 64]

The trainer's forward and backward (`token_logprobs` through `MultiLoRALinear`, sorted ids) in
one process, alternating two settings round by round so that both see the same machine:
- shared: `--threads` intra-op threads, `--runs` x `--rows` rows with one adapter per run (what
  one trainer holding every run does per micro-batch);
- alone: 1 thread, `--rows` rows with one adapter (what each of the single-run trainers does).
`efficiency` = the shared setting's tokens/s over `--threads` x the alone setting's: 1.0 means
the threads do as well as that many single-thread processes (the ceiling of "one trainer vs K
trainers" where forward and backward are the whole step; benchmarks.multirun_throughput measures
the processes themselves).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import report
from benchmarks.multirun_throughput import benchmark_model
from rlplex.models.hf import load_causal_lm, load_tokenizer
from rlplex.models.lm import token_logprobs
from rlplex.multirun.trainer.lora_apply import MultiLoRAModules, apply_multi_lora

NAME = "multirun_threading"
WIDTH = 32


def step_fn(model: torch.nn.Module, lora: MultiLoRAModules, vocab: int, rows: int, runs: int) -> Callable[[], None]:
    gen = torch.Generator().manual_seed(rows * 31 + runs)
    tokens = torch.randint(3, vocab, (rows, WIDTH), generator=gen)
    attention = torch.ones(rows, WIDTH, dtype=torch.int64)
    ids = torch.arange(rows) * runs // rows  # packed run by run, as the trainer does

    def step() -> None:
        with lora.active_adapters(ids):
            logprobs = token_logprobs(model, tokens, attention)
        logprobs.sum().backward()

    return step


def seconds_per_step(step: Callable[[], None], threads: int, repeats: int) -> float:
    torch.set_num_threads(threads)
    step()  # warm: the first call of a shape pays for allocation
    started = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - started) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", default="tiny", help="tiny (default), smollm2 or a [model] name")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--rows", type=int, default=64, help="rows of one run's micro-batch")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.repeats = 2, 2
    spec = benchmark_model(args.model)
    model = load_causal_lm(spec, torch.device("cpu")).eval()
    lora = apply_multi_lora(model, rank=8, n_adapters=args.runs, lora_dtype=torch.float32)
    vocab = len(load_tokenizer(spec))
    shared = step_fn(model, lora, vocab, args.runs * args.rows, args.runs)
    alone = step_fn(model, lora, vocab, args.rows, 1)
    times: dict[str, list[float]] = {"shared": [], "alone": []}
    for _ in range(args.rounds):
        times["shared"].append(seconds_per_step(shared, args.threads, args.repeats))
        times["alone"].append(seconds_per_step(alone, 1, args.repeats))
    # The first round also warms the caches and the allocator: medians of the others.
    kept = {name: values[1:] if len(values) > 1 else values for name, values in times.items()}
    shared_s, alone_s = statistics.median(kept["shared"]), statistics.median(kept["alone"])
    shared_tps = args.runs * args.rows * WIDTH / shared_s
    alone_tps = args.rows * WIDTH / alone_s
    efficiency = shared_tps / (args.threads * alone_tps)
    rows = [
        [f"shared: {args.threads} threads, {args.runs} runs", args.runs * args.rows, 1000 * shared_s, shared_tps],
        ["alone: 1 thread, 1 run", args.rows, 1000 * alone_s, alone_tps],
    ]
    figures = {
        "model": spec.name,
        "runs": args.runs,
        "rows": args.rows,
        "width": WIDTH,
        "threads": args.threads,
        "seconds": times,
        "efficiency": efficiency,
    }
    report(
        NAME,
        f"forward+backward: {args.threads} threads reach {efficiency:.2f} of {args.threads} single-thread processes",
        ["setting", "rows", "ms per step (median)", "tokens/s"],
        rows,
        figures,
    )


if __name__ == "__main__":
    main()
