"""Model workers: where an MFC's interface call runs, next to the tensors it produces.

`ModelWorker` is the process boundary: the executor hands a worker an MFC, the ids of its
shard and the data plane; the worker fetches the inputs it lacks from the stores that own
them, runs the model's interface call and keeps the outputs in its own store. It returns,
per output key, one entry per datapoint: the value itself (in-process workers) or a
`ValueInfo` with its dtype and rank (process workers), which is all the master validates.
`LocalModelWorker` runs the call on a thread of its own, so MFCs of different models
overlap while the asyncio loop keeps dispatching; a worker in another process implements
the same protocol over the control plane's RPC.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from rlplex.dataflow.dataplane import DataPlane, LocalTensorStore, TensorStore
from rlplex.dataflow.mfc import MFCDef, MFCExecutionError
from rlplex.errors import RlplexError

Outputs = dict[str, list[Any]]


class ModelInterface(Protocol):
    """What a model does for each kind of MFC; each returns one value per datapoint per output key.

    A model implements only the calls its MFCs use; a missing one fails at dispatch, naming it.
    """

    def generate(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> Outputs: ...

    def inference(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> Outputs: ...

    def train_step(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> Outputs: ...


class ModelWorker(Protocol):
    name: str

    @property
    def store(self) -> TensorStore: ...  # read-only here, so a worker may hold a narrower store type

    async def run(self, mfc: MFCDef, ids: Sequence[int], plane: DataPlane) -> Outputs: ...


class LocalModelWorker:
    def __init__(self, name: str, interface: object) -> None:
        self.name = name
        self.interface = interface
        self.store: TensorStore = LocalTensorStore(name)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"worker-{name}")

    def _call(self, mfc: MFCDef, ids: Sequence[int], plane: DataPlane) -> Outputs:
        inputs = {key: plane.gather(ids, key) for key in mfc.input_keys}
        method = getattr(self.interface, mfc.interface_type.value, None)
        if method is None:
            raise MFCExecutionError(
                f"MFC {mfc.name!r}: model worker {self.name!r} ({type(self.interface).__name__}) "
                f"has no {mfc.interface_type.value!r} call"
            )
        outputs: Outputs = method(mfc, inputs)
        for key in mfc.output_keys:
            if key in outputs and len(outputs[key]) == len(ids):
                self.store.put_many(ids, key, outputs[key])
        return outputs

    async def run(self, mfc: MFCDef, ids: Sequence[int], plane: DataPlane) -> Outputs:
        future = self._thread.submit(self._call, mfc, ids, plane)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            drop_when_done(future, self.store, ids)
            raise

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)


def drop_when_done(future: Future[Any], store: TensorStore, ids: Sequence[int]) -> None:
    """A cancelled call's thread runs on: drop whatever it stores for `ids` once it ends, or the
    abandoned step's values would outlive it (the step has already released `ids`)."""
    if future.cancel():
        return  # never started
    ids = list(ids)

    def drop(_: Future[Any]) -> None:
        try:
            store.drop(ids)
        except RlplexError:
            pass  # a worker that is gone holds nothing

    future.add_done_callback(drop)


def split_by_tokens(seqlens: Sequence[int], n_parts: int) -> list[list[int]]:
    """Positions into `n_parts` shards of nearly equal token totals (longest first, greedy)."""
    shards: list[list[int]] = [[] for _ in range(n_parts)]
    totals = [0] * n_parts
    for position in sorted(range(len(seqlens)), key=lambda i: -seqlens[i]):
        lightest = totals.index(min(totals))
        shards[lightest].append(position)
        totals[lightest] += seqlens[position]
    return [sorted(shard) for shard in shards]


def split_by_count(n: int, n_parts: int) -> list[list[int]]:
    return [list(range(n))[i::n_parts] for i in range(n_parts)]
