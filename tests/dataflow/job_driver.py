"""The dataflow master as a driver role of a control-plane job (imported by node processes)."""

from __future__ import annotations

import asyncio
import itertools

from process_interfaces import GRAPH

from rlplex.control import WorkerContext
from rlplex.dataflow import FunctionExecutor
from rlplex.dataflow.job_worker import JobModelWorker


def drive(context: WorkerContext) -> None:
    sizes = {"generator": 2, "reward": 1, "trainer": 1}
    workers = {role: [JobModelWorker(context, role, r).start() for r in range(n)] for role, n in sizes.items()}
    executor = FunctionExecutor(GRAPH, workers, ({"prompt": i} for i in itertools.count()), capacity=16)
    loop = asyncio.new_event_loop()
    try:
        for step in range(int(context.config.get("steps", 1))):
            loop.run_until_complete(asyncio.wait_for(executor.execute_step(), 90))
            context.report_progress(steps=step + 1)
    finally:
        loop.close()
        restarts = sum(w.restarts for ws in workers.values() for w in ws)
        (context.output_dir / "driver_restarts.txt").write_text(str(restarts))
        for group in workers.values():
            for worker in group:
                worker.close()
