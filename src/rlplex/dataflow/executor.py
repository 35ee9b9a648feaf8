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
which MFC waits for which keys on which ids. A failed step cancels and awaits every MFC
loop and shard call of the step (a bare `gather` that already failed cancels nothing, and
its orphans would train the next step's batch), then forgets the step's datapoints and
drops their values from every store, so the executor is clean for the next step.

Faults: a process worker that dies is restarted by its handle, which bumps its store's
incarnation; the values it held are lost. A call whose inputs are lost (found before the
call, or as the reason it failed) first recomputes them: the MFC that produced each lost
key runs again on those ids, then every MFC downstream that had already consumed them, so
that a reward never belongs to a sequence that no longer exists. Keys from the dataset are
held by the master and never lost; keys produced by a train_step are never rerun. A call
in flight that read a lost value before the death is not rerun (a narrow window).

A dataset that runs dry ends the step at once with `DatasetExhaustedError`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import traceback
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from typing import Any

from rlplex.dataflow.buffer import SequenceBuffer
from rlplex.dataflow.dataplane import DataPlane, DataPlaneError, LocalTensorStore
from rlplex.dataflow.mfc import MFCDef, MFCExecutionError, MFCGraph, ModelInterfaceType
from rlplex.dataflow.workers import ModelWorker, Outputs, split_by_count, split_by_tokens
from rlplex.errors import RlplexError


class DatasetExhaustedError(RlplexError):
    """The dataset ran out before a step's batch was complete: the natural end of a finite run."""


async def gather_or_cancel(*awaitables: Awaitable[Any]) -> list[Any]:
    """`asyncio.gather`, except that the first failure (or a cancellation from outside)
    cancels the others and awaits them before it is raised: nothing of the group outlives it."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        pending = [t for t in tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    errors = [error for t in tasks if not t.cancelled() and (error := t.exception()) is not None]
    if errors:
        raise errors[0]  # the first in submission order; the others were retrieved above
    return [task.result() for task in tasks]


class FunctionExecutor:
    def __init__(
        self,
        graph: MFCGraph,
        workers: Mapping[str, Sequence[ModelWorker]],
        dataset: Iterator[dict[str, Any]],
        capacity: int = 1024,
        step_timeout: float | None = 600.0,
        seqlen_key: str | None = None,
        birth_key: str | None = None,
        max_recomputes: int = 3,
    ) -> None:
        missing = {m.model_name for m in graph.mfcs} - set(workers)
        if missing:
            raise MFCExecutionError(f"no workers for models {sorted(missing)}")
        empty = sorted(m.model_name for m in graph.mfcs if not workers[m.model_name])
        if empty:
            raise MFCExecutionError(f"empty worker groups for models {sorted(set(empty))}; each needs at least one")
        self.graph = graph
        self.workers = workers
        self.dataset = dataset
        self.step_timeout = step_timeout
        self.seqlen_key = seqlen_key
        self.birth_key = birth_key  # item key of each datapoint's birth time (time.monotonic clock)
        self.max_recomputes = max_recomputes
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
        self._step_ids: list[int] = []
        self._recompute_lock: asyncio.Lock | None = None
        self.recomputed = 0  # datapoint-MFC pairs run again after a worker lost their inputs
        self.step_count = 0

    # ----- data loading -------------------------------------------------------------------
    async def load_data(self, n: int) -> list[int]:
        """Put `n` datapoints from the dataset; `DatasetExhaustedError` if fewer remain."""
        # Off the event loop, in one hop: a streaming dataset blocks until rollouts arrive.
        items = await asyncio.to_thread(lambda: list(itertools.islice(self.dataset, n)))
        if len(items) < n:
            raise DatasetExhaustedError(
                f"the dataset is exhausted: {len(items)} datapoints left for a step of {n} (dropped)"
            )
        keys = list(self.graph.dataset_keys)
        seqlens = [len(item[self.seqlen_key]) if self.seqlen_key else 1 for item in items]
        births = [float(item[self.birth_key]) for item in items] if self.birth_key else None
        ids = await self.buffer.put_batch(keys, seqlens, timeout=self.step_timeout, birth_times=births)
        self._step_ids.extend(ids)
        for key in keys:
            self.dataset_store.put_many(ids, key, [item[key] for item in items])
        self.plane.record(self.dataset_store.name, ids, keys)
        return ids

    # ----- one MFC call -------------------------------------------------------------------
    async def run_mfc_once(self, mfc: MFCDef) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = await self.buffer.get_batch_for_rpc(mfc, timeout=self.step_timeout)
        waited = time.perf_counter() - t0
        await self._run_on(mfc, list(batch.ids), list(batch.seqlens))
        if mfc.output_keys:
            self.buffer.amend_batch(batch.ids, list(mfc.output_keys))
        freed = self.buffer.finish(mfc, batch.ids)
        self.plane.release(freed)
        return {f"timings/{mfc.name}_wait_s": waited, f"timings/{mfc.name}_run_s": time.perf_counter() - t0 - waited}

    async def _run_on(
        self, mfc: MFCDef, ids: list[int], seqlens: Sequence[int] | None = None, recover: bool = True
    ) -> None:
        """Run `mfc` on `ids` across its workers; record the outputs once every shard succeeded."""
        group = self.workers[mfc.model_name]
        if mfc.interface_type == ModelInterfaceType.GENERATE or seqlens is None:
            shards = split_by_count(len(ids), len(group))
        else:
            shards = split_by_tokens(seqlens, len(group))
        placed = [(w, [ids[p] for p in shard]) for w, shard in zip(group, shards, strict=True) if shard]
        calls = (self._call_shard(w, mfc, shard_ids, recover) for w, shard_ids in placed)
        results = await gather_or_cancel(*calls)
        for (worker, shard_ids), outputs in zip(placed, results, strict=True):
            self._validate(mfc, worker, shard_ids, outputs)
        for worker, shard_ids in placed:
            self.plane.record(worker.store.name, shard_ids, list(mfc.output_keys))

    async def _call_shard(self, worker: ModelWorker, mfc: MFCDef, ids: list[int], recover: bool) -> Outputs:
        attempt = 0 if recover else self.max_recomputes
        while True:
            lost = self.plane.lost(ids, mfc.input_keys)
            if lost:
                if attempt >= self.max_recomputes:
                    raise DataPlaneError(
                        f"MFC {mfc.name!r}: inputs still lost after {attempt} recomputes: "
                        f"{ {k: v[:10] for k, v in lost.items()} }"
                    )
                attempt += 1
                await self._recompute(lost, requester=mfc.name)
            try:
                return await self._call(worker, mfc, ids)
            except (MFCExecutionError, DataPlaneError):
                # A worker that died holding our inputs fails the call (its new store lacks
                # them, or its old one refuses connections until it is restarted); recompute
                # and try again. Any other failure is the step's.
                if not self.plane.lost(ids, mfc.input_keys):
                    await self._revive_owners(ids, mfc.input_keys)
                if not self.plane.lost(ids, mfc.input_keys) or attempt >= self.max_recomputes:
                    raise

    async def _revive_owners(self, ids: Sequence[int], keys: Sequence[str]) -> None:
        owners = {store for key in keys for store in self.plane.locate(ids, key)}
        for group in self.workers.values():
            for worker in group:
                revive = getattr(worker, "revive", None)
                if worker.store.name in owners and revive is not None:
                    await revive()

    async def _recompute(self, lost: dict[str, list[int]], requester: str) -> None:
        if self._recompute_lock is None:
            self._recompute_lock = asyncio.Lock()
        async with self._recompute_lock:
            # Another call may have recomputed the same values while this one waited.
            lost = self.plane.lost({i for ids in lost.values() for i in ids}, list(lost))
            rerun: dict[str, set[int]] = {}
            self._add_producers(lost, rerun)
            for mfc in reversed(self.graph.mfcs):  # a rerun whose own inputs are lost needs theirs first
                if mfc.name in rerun:
                    self._add_producers(self.plane.lost(rerun[mfc.name], mfc.input_keys), rerun)
            for mfc in self.graph.mfcs:  # topological: a producer reruns before its consumers
                ids = sorted(i for i in rerun.get(mfc.name, ()) if i in self.buffer)
                if not ids:
                    continue
                if mfc.interface_type == ModelInterfaceType.TRAIN_STEP:
                    raise DataPlaneError(
                        f"key(s) {list(mfc.output_keys)} of datapoints {ids[:10]} were lost and come from "
                        f"train_step MFC {mfc.name!r}, which is never run twice"
                    )
                await self._run_on(mfc, ids, recover=False)
                self.recomputed += len(ids)
                for child in self.graph.children[mfc.name]:
                    child_mfc = self.graph.get(child)
                    if child != requester and child_mfc.output_keys:
                        done = [i for i in ids if self.plane.has(i, child_mfc.output_keys[0])]
                        rerun.setdefault(child, set()).update(done)

    def _add_producers(self, lost: dict[str, list[int]], rerun: dict[str, set[int]]) -> None:
        for key, ids in lost.items():
            producer = self.graph.producer.get(key)
            if producer is None:
                raise DataPlaneError(f"dataset key {key!r} of datapoints {ids[:10]} was lost")
            rerun.setdefault(producer, set()).update(ids)

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
        """Load one step's datapoints and run every MFC until the final ones have consumed them.

        On any failure (or cancellation) every MFC of the step is cancelled and awaited and
        the step's datapoints are forgotten and their values dropped before the error is raised.
        """
        t0 = time.perf_counter()
        self._step_ids = []
        try:
            _, *results = await gather_or_cancel(
                self.load_data(self.batch_size),
                *(self._mfc_loop(mfc, self.batch_size // mfc.n_seqs) for mfc in self.graph.mfcs),
            )
        except BaseException:
            self._abandon_step()
            raise
        self._step_ids = []
        metrics: dict[str, float] = {}
        for result in results:
            for key, value in result.items():
                metrics[key] = metrics.get(key, 0.0) + value
        self.step_count += 1
        metrics["timings/step_s"] = time.perf_counter() - t0
        return metrics

    def _abandon_step(self) -> None:
        ids, self._step_ids = self._step_ids, []
        self.buffer.discard(ids)
        self.plane.release(ids)

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
