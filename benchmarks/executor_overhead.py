"""FunctionExecutor dispatch overhead: a graph of no-op MFCs on local model workers.

    python -m benchmarks.executor_overhead [--quick]

Every MFC call does no model work, so the time per call is what the executor costs:
waiting for readiness, sharding, the worker hop, output validation, amending and release.
Goal (issue 4): per-call dispatch overhead <= 2 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from typing import Any

from benchmarks.common import report
from rlplex.dataflow import FunctionExecutor, LocalModelWorker, MFCDef, ModelInterfaceType, build_graph


class NoOp:
    def generate(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        n = len(next(iter(inputs.values())))
        return {key: [0] * n for key in mfc.output_keys}

    inference = generate

    def train_step(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        return {}


def measure(batch: int, workers_per_model: int, steps: int) -> dict[str, float]:
    gen, inf, train = ModelInterfaceType.GENERATE, ModelInterfaceType.INFERENCE, ModelInterfaceType.TRAIN_STEP
    graph = build_graph(
        [
            MFCDef("actor_gen", "actor", gen, ("prompt",), ("ids", "logp"), batch),
            MFCDef("ref_inf", "ref", inf, ("ids",), ("ref_logp",), batch),
            MFCDef("rew_inf", "reward", inf, ("ids",), ("reward",), batch),
            MFCDef("actor_train", "actor", train, ("ids", "logp", "ref_logp", "reward"), (), batch),
        ],
        dataset_keys=("prompt",),
    )
    workers = {
        model: [LocalModelWorker(f"{model}{i}", NoOp()) for i in range(workers_per_model)]
        for model in ("actor", "ref", "reward")
    }
    executor = FunctionExecutor(graph, workers, ({"prompt": i} for i in itertools.count()), capacity=4 * batch)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(executor.execute_step())  # warm-up
        t0 = time.perf_counter()
        for _ in range(steps):
            loop.run_until_complete(executor.execute_step())
        elapsed = time.perf_counter() - t0
    finally:
        loop.close()
        for group in workers.values():
            for worker in group:
                worker.close()
    calls = steps * len(graph.mfcs)
    return {
        "batch": batch,
        "workers_per_model": workers_per_model,
        "steps": steps,
        "ms_per_step": 1e3 * elapsed / steps,
        "ms_per_call": 1e3 * elapsed / calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps = 50 if args.quick else 300
    results = [measure(batch, n, steps) for batch, n in ((16, 1), (16, 2), (256, 1), (256, 2))]
    rows = [(r["batch"], r["workers_per_model"], r["ms_per_step"], r["ms_per_call"]) for r in results]
    worst = max(r["ms_per_call"] for r in results)
    report(
        "executor_overhead",
        "FunctionExecutor dispatch overhead (4 no-op MFCs)",
        ("batch", "workers/model", "ms per step", "ms per MFC call"),
        rows,
        {"results": results, "worst_ms_per_call": worst, "goal_ms_per_call": 2.0, "meets_goal": worst <= 2.0},
    )


if __name__ == "__main__":
    main()
