"""`FunctionExecutor`: runs the MFCs of an RL step as soon as their inputs are ready.

    dataset --load_data--> SequenceBuffer (metadata) <--get_batch_for_rpc / amend_batch-- MFC loops
                                   |                                                        |
                                DataPlane (who owns which tensor)  <---- outputs stay in ---+-- worker stores

Every MFC runs its own loop concurrently with the others; a loop waits in
`get_batch_for_rpc` until its inputs are present, splits the batch across its model's
data-parallel workers (by tokens for training and inference, by count for generation),
validates what the workers return, then amends the buffer. A step ends when the final MFCs
have consumed one step's datapoints. Where backpressure comes from:

| wait                  | cause                                   |
| --------------------- | --------------------------------------- |
| `load_data` put       | buffer at capacity (consumers behind)   |
| MFC get_batch_for_rpc | inputs not yet produced upstream (data) |

A worker's exception fails the step with the MFC and the worker named and its traceback;
outputs are amended only after every shard succeeded, so the buffer never holds a
half-written batch. A step that stalls past `step_timeout` fails with the buffer's dump of
which MFC waits for which keys on which ids.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rlplex.dataflow.buffer import SequenceBuffer
from rlplex.dataflow.dataplane import DataPlane, LocalTensorStore
from rlplex.dataflow.mfc import MFCDef, MFCExecutionError, MFCGraph, ModelInterfaceType
from rlplex.dataflow.workers import ModelWorker, Outputs, split_by_count, split_by_tokens
from rlplex.errors import RlplexError


class FunctionExecutor:
    def __init__(
        self,
        graph: MFCGraph,
        workers: Mapping[str, Sequence[ModelWorker]],
        dataset: Iterator[dict[str, Any]],
        capacity: int = 1024,
        step_timeout: float | None = 600.0,
        seqlen_key: str | None = None,
    ) -> None:
        missing = {m.model_name for m in graph.mfcs} - set(workers)
        if missing:
            raise MFCExecutionError(f"no workers for models {sorted(missing)}")
        self.graph = graph
        self.workers = workers
        self.dataset = dataset
        self.step_timeout = step_timeout
        self.seqlen_key = seqlen_key
        self.batch_size = max(m.n_seqs for m in graph.final_mfcs)
        for mfc in graph.mfcs:
            if self.batch_size % mfc.n_seqs:
                raise MFCExecutionError(
                    f"MFC {mfc.name!r}: n_seqs {mfc.n_seqs} does not divide the step's batch of {self.batch_size}"
                )
        self.buffer = SequenceBuffer(graph.mfcs, graph.all_keys, capacity)
        self.dataset_store = LocalTensorStore("dataset")
        stores = [self.dataset_store, *(w.store for group in workers.values() for w in group)]
        self.plane = DataPlane(stores)
        self._dtypes: dict[str, tuple[str, int]] = {}
        self.step_count = 0

    # ----- data loading -------------------------------------------------------------------
    async def load_data(self, n: int) -> list[int]:
        # Off the event loop, in one hop: a streaming dataset blocks until rollouts arrive.
        items = await asyncio.to_thread(lambda: list(itertools.islice(self.dataset, n)))
        if not items:
            return []
        keys = list(self.graph.dataset_keys)
        seqlens = [len(item[self.seqlen_key]) if self.seqlen_key else 1 for item in items]
        ids = await self.buffer.put_batch(keys, seqlens, timeout=self.step_timeout)
        for key in keys:
            self.dataset_store.put_many(ids, key, [item[key] for item in items])
        self.plane.record(self.dataset_store.name, ids, keys)
        return ids

    # ----- one MFC call -------------------------------------------------------------------
    async def run_mfc_once(self, mfc: MFCDef) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = await self.buffer.get_batch_for_rpc(mfc, timeout=self.step_timeout)
        waited = time.perf_counter() - t0
        group = self.workers[mfc.model_name]
        if mfc.interface_type == ModelInterfaceType.GENERATE:
            shards = split_by_count(len(batch.ids), len(group))
        else:
            shards = split_by_tokens(batch.seqlens, len(group))
        shard_ids = [[batch.ids[p] for p in shard] for shard in shards]
        calls = [self._call(worker, mfc, ids) for worker, ids in zip(group, shard_ids, strict=True) if ids]
        results = await asyncio.gather(*calls)
        for (worker, ids), outputs in zip(
            [(w, i) for w, i in zip(group, shard_ids, strict=True) if i], results, strict=True
        ):
            self._validate(mfc, worker, ids, outputs)
            self.plane.record(worker.name, ids, list(mfc.output_keys))
        if mfc.output_keys:
            self.buffer.amend_batch(batch.ids, list(mfc.output_keys))
        freed = self.buffer.finish(mfc, batch.ids)
        self.plane.release(freed)
        return {f"timings/{mfc.name}_wait_s": waited, f"timings/{mfc.name}_run_s": time.perf_counter() - t0 - waited}

    async def _call(self, worker: ModelWorker, mfc: MFCDef, ids: list[int]) -> Outputs:
        try:
            return await worker.run(mfc, ids, self.plane)
        except RlplexError:
            raise
        except Exception as error:
            trace = "".join(traceback.format_exception(error))
            raise MFCExecutionError(f"MFC {mfc.name!r} failed on worker {worker.name!r}:\n{trace}") from error

    def _validate(self, mfc: MFCDef, worker: ModelWorker, ids: Sequence[int], outputs: Outputs) -> None:
        for key in mfc.output_keys:
            if key not in outputs:
                raise MFCExecutionError(
                    f"MFC {mfc.name!r} on worker {worker.name!r} did not return declared key {key!r}"
                )
            values = outputs[key]
            if len(values) != len(ids):
                raise MFCExecutionError(f"MFC {mfc.name!r} key {key!r}: {len(values)} values for {len(ids)} datapoints")
            for value in values:
                kind = _kind(value)
                expected = self._dtypes.setdefault(key, kind)
                if kind != expected:
                    raise MFCExecutionError(f"MFC {mfc.name!r} key {key!r}: got dtype/ndim {kind}, expected {expected}")

    # ----- a step -------------------------------------------------------------------------
    async def execute_step(self) -> dict[str, float]:
        """Load one step's datapoints and run every MFC until the final ones have consumed them."""
        t0 = time.perf_counter()
        loader = asyncio.create_task(self.load_data(self.batch_size))
        loops = asyncio.gather(*(self._mfc_loop(mfc, self.batch_size // mfc.n_seqs) for mfc in self.graph.mfcs))
        try:
            _, results = await asyncio.gather(loader, loops)
        except BaseException:
            loader.cancel()
            loops.cancel()
            raise
        metrics: dict[str, float] = {}
        for result in results:
            for key, value in result.items():
                metrics[key] = metrics.get(key, 0.0) + value
        self.step_count += 1
        metrics["timings/step_s"] = time.perf_counter() - t0
        return metrics

    async def _mfc_loop(self, mfc: MFCDef, calls: int) -> dict[str, float]:
        totals: dict[str, float] = {}
        for _ in range(calls):
            for key, value in (await self.run_mfc_once(mfc)).items():
                totals[key] = totals.get(key, 0.0) + value
        return totals


def _kind(value: Any) -> tuple[str, int]:
    dtype = getattr(value, "dtype", None)
    if dtype is not None:
        return str(dtype), int(getattr(value, "ndim", 0))
    return type(value).__name__, 0
