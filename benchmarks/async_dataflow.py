"""Asynchronous against synchronous dataflow throughput on a synthetic workload.

    python -m benchmarks.async_dataflow [--quick]

Generation of one batch takes G seconds and a train step T seconds (simulated by waiting,
so the figure isolates the dataflow machinery: admission, stream, executor, weight sync).
Synchronous (eta = 0) costs G + T per step; asynchronous (eta >= 1) overlaps them, ideally
max(G, T). Goal (issue 4): async/sync >= 0.9 * (G + T) / max(G, T).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Iterator
from typing import Any

from benchmarks.common import report
from rlplex.dataflow import FunctionExecutor, LocalModelWorker, MFCDef, ModelInterfaceType, build_graph
from rlplex.dataflow.stream import RolloutWorker, StalenessController, StreamDataset, WeightBroadcaster


class SleepyTrainer:
    def __init__(self, seconds: float, weights: WeightBroadcaster, controller: StalenessController) -> None:
        self.seconds, self.weights, self.controller, self.version = seconds, weights, controller, 0

    def train_step(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        time.sleep(self.seconds)
        self.version += 1
        self.weights.publish(self.version, {})
        self.controller.set_version(self.version)
        return {}


def run(gen_s: float, train_s: float, eta: int, steps: int, batch: int = 16, group: int = 4) -> float:
    controller = StalenessController(batch, eta)
    stream = StreamDataset((eta + 1) * batch)
    weights = WeightBroadcaster()

    def rollout(_: int) -> list[dict[str, Any]]:
        time.sleep(gen_s * group / batch)  # one batch of `batch` samples takes gen_s
        return [{"x": 1} for _ in range(group)]

    worker = RolloutWorker("r0", rollout, lambda state: None, group, controller, stream, weights)

    def data() -> Iterator[dict[str, Any]]:
        while True:
            yield stream.get(timeout=60).data

    graph = build_graph([MFCDef("train", "actor", ModelInterfaceType.TRAIN_STEP, ("x",), (), batch)], ("x",))
    trainer = LocalModelWorker("t", SleepyTrainer(train_s, weights, controller))
    executor = FunctionExecutor(graph, {"actor": [trainer]}, data(), capacity=batch)
    loop = asyncio.new_event_loop()
    worker.start()
    try:
        loop.run_until_complete(executor.execute_step())  # warm-up step, not timed
        t0 = time.perf_counter()
        for _ in range(steps):
            loop.run_until_complete(executor.execute_step())
        return steps / (time.perf_counter() - t0)
    finally:
        controller.close()
        stream.close()
        worker.join(timeout=10)
        trainer.close()
        loop.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps = 8 if args.quick else 25
    rows, results = [], []
    for gen_s, train_s in ((0.05, 0.05), (0.08, 0.04), (0.04, 0.08)):
        sync = run(gen_s, train_s, eta=0, steps=steps)
        for eta in (1, 4):
            asynchronous = run(gen_s, train_s, eta=eta, steps=steps)
            ideal = (gen_s + train_s) / max(gen_s, train_s)
            ratio = asynchronous / sync
            results.append(
                {
                    "G_s": gen_s,
                    "T_s": train_s,
                    "eta": eta,
                    "sync_steps_per_s": sync,
                    "async_steps_per_s": asynchronous,
                    "ratio": ratio,
                    "ideal": ideal,
                    "meets_goal": ratio >= 0.9 * ideal,
                }
            )
            rows.append(
                (gen_s, train_s, eta, sync, asynchronous, ratio, ideal, "yes" if ratio >= 0.9 * ideal else "no")
            )
    columns = ("G s", "T s", "eta", "sync steps/s", "async steps/s", "async/sync", "(G+T)/max", ">= 0.9 ideal")
    report("async_dataflow", "async vs sync dataflow (synthetic G, T)", columns, rows, {"results": results})


if __name__ == "__main__":
    main()
