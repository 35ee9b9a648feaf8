"""Model workers in processes of their own: the model, its interface and its tensor store
live in the child; the master sends ids and locations, never tensors.

    master (executor) --run(request): mfc, ids, where each input lives--> worker child
    worker child --get(ids, key)--> peer worker (inputs it lacks)
    worker child: interface call -> outputs into its own store -> ValueInfo per value back

Inputs held by stores in the master process (the dataset's prompts) are sent inline; all
others are fetched peer to peer. Every hop is `rlplex.control.rpc`: one `AuthListener` per
worker (127.0.0.1, a per-executor HMAC key; an idle or garbage client blocks nobody), msgpack
with raw array bytes (no pickle), a timeout on every connect and call. A worker handle keeps
one call in flight on its connection (calls of several MFCs on one worker queue on one
thread); store operations (`drop`, `size`) go over a second connection, so a release never
waits behind a long model call.

A child that dies during a call (SIGKILL, OOM) is started again and the call is issued
again, up to `max_restarts` times, so no datapoint is lost or run twice: a call's outputs
are recorded only when it returns. Values the dead child held for other datapoints are
gone: the restart bumps the store's `incarnation`, and the executor recomputes them from
the MFC that produced them. A call that gets no reply within `call_timeout_s` (a hung
child) fails with `WaitTimeoutError` naming the MFC and the worker. This handle restarts its
child itself; under a control-plane job, `rlplex.dataflow.job_worker` leaves restarts to the
job's restart policy.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Self

from rlplex.control.rpc import (
    Address,
    AuthListener,
    RpcClient,
    RpcConnectionLost,
    RpcRemoteError,
    format_address,
    serve,
)
from rlplex.dataflow.dataplane import DataPlane, DataPlaneError, LocalTensorStore
from rlplex.dataflow.mfc import MFCDef, MFCExecutionError, ModelInterfaceType
from rlplex.dataflow.workers import Outputs, drop_when_done
from rlplex.errors import NodeFailedError, WaitTimeoutError, WorkerDiedError
from rlplex.processes import CONTEXT, start_process, stop_processes

CONNECT_TIMEOUT_S = 30.0  # a live peer answers the handshake in milliseconds; a stopped one never
CALL_TIMEOUT_S = 600.0  # the default for one MFC call (a model's generate or train step)
STORE_TIMEOUT_S = 60.0  # a store operation: get, drop, size

InterfaceFactory = Callable[[], object]
"""Builds the model interface inside the child; must be picklable (a class or a partial)."""


@dataclass(frozen=True)
class ValueInfo:
    """What the master learns of a value a process worker keeps: enough to validate it."""

    dtype: str
    ndim: int


def _info(value: Any) -> list[Any]:
    dtype = getattr(value, "dtype", None)
    if dtype is not None:
        return [str(dtype), int(getattr(value, "ndim", 0))]
    return [type(value).__name__, 0]


# ----- the serving side -----------------------------------------------------------------
class ModelServer:
    """The serving side of a model worker: the interface and its tensor store behind one
    `AuthListener`. The master calls `run` (one MFC call at a time), `drop` and `size`;
    peers call `get`. Hosted by a spawned child here, and by a control-plane node in
    `rlplex.dataflow.job_worker`; `on_call` (optional) runs after each MFC call."""

    def __init__(self, name: str, interface: object, authkey: bytes, on_call: Callable[[], None] | None = None) -> None:
        self.name, self.interface, self.authkey, self.on_call = name, interface, authkey, on_call
        self.store, self.lock = LocalTensorStore(name), threading.Lock()
        self.calls = 0
        self._run_lock = threading.Lock()  # one interface call at a time, whoever connects
        self._peers: dict[Address, RpcClient] = {}
        self.listener = AuthListener("127.0.0.1", authkey, lambda conn: serve(conn, self.handle), name=f"model-{name}")

    @property
    def address(self) -> Address:
        return self.listener.address

    def handle(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        if method == "run":
            with self._run_lock:
                infos = self._run(args[0])
                self.calls += 1
            if self.on_call is not None:
                self.on_call()
            return infos
        with self.lock:
            if method == "get":
                return self.store.get_many(args[0], str(args[1]))
            if method == "drop":
                self.store.drop(args[0])
                return None
            if method == "size":
                return len(self.store)
        raise AttributeError(f"model worker {self.name!r} has no call {method!r}")

    def _run(self, request: dict[str, Any]) -> dict[str, list[Any]]:
        mfc = MFCDef(
            request["name"],
            request["model"],
            ModelInterfaceType(request["interface"]),
            tuple(request["input_keys"]),
            tuple(request["output_keys"]),
            int(request["n_seqs"]),
        )
        ids: list[int] = request["ids"]
        inputs: dict[str, list[Any]] = {}
        for key, spec in request["inputs"].items():
            if "inline" in spec:
                inputs[key] = spec["inline"]
                continue
            fetched: dict[int, Any] = {}
            for address, store_ids in spec["from"]:
                if address is None:
                    with self.lock:
                        values = self.store.get_many(store_ids, key)
                else:
                    values = self._peer_get((str(address[0]), int(address[1])), store_ids, key)
                fetched.update(zip(store_ids, values, strict=True))
            inputs[key] = [fetched[i] for i in ids]
        method = getattr(self.interface, mfc.interface_type.value, None)
        if method is None:
            raise MFCExecutionError(f"{type(self.interface).__name__} has no {mfc.interface_type.value!r} call")
        outputs: Outputs = method(mfc, inputs)
        infos: dict[str, list[Any]] = {}
        with self.lock:
            for key, values in outputs.items():
                if len(values) == len(ids):
                    self.store.put_many(ids, key, values)
                infos[key] = [_info(v) for v in values]
        return infos

    def _peer_get(self, address: Address, ids: list[int], key: str) -> list[Any]:
        label = format_address(address)
        if address not in self._peers:
            self._peers[address] = RpcClient(
                address, self.authkey, f"peer store {label}", STORE_TIMEOUT_S, CONNECT_TIMEOUT_S
            )
        try:
            return list(self._peers[address].call("get", ids, key))
        except RpcConnectionLost as error:
            self._peers.pop(address).close()  # a dead peer's connection must not be reused
            raise DataPlaneError(f"peer store {label} is gone ({error}); its {key!r} values are lost") from None
        except RpcRemoteError as error:
            raise DataPlaneError(str(error)) from None

    def close(self) -> None:
        self.listener.close()
        for peer in self._peers.values():
            peer.close()


def _child_main(name: str, factory: InterfaceFactory, authkey: bytes, parent: Connection) -> None:
    import torch

    torch.set_num_threads(1)
    server = ModelServer(name, factory(), authkey)
    parent.send(server.address)
    try:
        parent.recv()  # the handle closes its end (or its process dies): this child's work is over
    except (EOFError, OSError):
        pass
    server.close()


# ----- the master's handle --------------------------------------------------------------
class RemoteTensorStore:
    """The master's view of a child's store: drop and size over a connection of their own."""

    def __init__(self, name: str, connect_timeout_s: float | None = None) -> None:
        self.name = name
        self.address: Address | None = None
        self.incarnation = 0  # grows when the child is replaced: what the old one held is gone
        self.connect_timeout_s = connect_timeout_s
        self._client: RpcClient | None = None
        self._authkey = b""
        self._lock = threading.Lock()

    def connect(self, address: Address, authkey: bytes) -> None:
        with self._lock:
            self.address, self._authkey, self._client = address, authkey, None

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            if self.address is None:
                raise DataPlaneError(f"store {self.name!r} is not running")
            if self._client is None:
                timeout = CONNECT_TIMEOUT_S if self.connect_timeout_s is None else self.connect_timeout_s
                self._client = RpcClient(self.address, self._authkey, f"store {self.name!r}", STORE_TIMEOUT_S, timeout)
            client = self._client
        try:
            return client.call(method, *args)
        except RpcConnectionLost:
            with self._lock:
                if self._client is client:
                    self._client = None
            client.close()
            raise

    def get_many(self, ids: Sequence[int], key: str) -> list[Any]:
        try:
            return list(self._call("get", list(ids), key))
        except RpcRemoteError as error:
            raise DataPlaneError(str(error)) from None

    def put_many(self, ids: Sequence[int], key: str, values: Sequence[Any]) -> None:
        raise DataPlaneError(f"store {self.name!r} is written only by its worker")

    def drop(self, ids: Iterable[int]) -> None:
        try:
            self._call("drop", list(ids))
        except (NodeFailedError, WaitTimeoutError, DataPlaneError):
            pass  # a dead or stopped worker's values are gone already (or will be with it)

    def __len__(self) -> int:
        return int(self._call("size"))

    def reset(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
            self._client, self.address = None, None
            self.incarnation += 1


class RemoteModelWorker:
    """The master's handle on a model worker serving in another process: one call in flight on
    its connection, store operations on a second one, and a call that loses its server issued
    again on the server's next incarnation.

    Who starts that incarnation is the one thing its two kinds differ in: `ProcessModelWorker`
    spawns its own child, within a restart budget; `JobModelWorker` waits for the control plane,
    whose failure policy decides. A subclass implements `_launch` (start or find the server and
    return its address) and may refuse a replacement in `_check_budget`."""

    def __init__(
        self,
        name: str,
        authkey: bytes | None = None,
        connect_timeout_s: float | None = None,
        call_timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        self.name = name
        self.authkey = authkey or os.urandom(32)
        self.connect_timeout_s = connect_timeout_s
        self.call_timeout_s = call_timeout_s
        self.store = RemoteTensorStore(name, connect_timeout_s)
        self.restarts = 0
        self._client: RpcClient | None = None
        # One thread per handle: calls of several MFCs on this worker queue here, so one
        # call is in flight on the connection at a time (the server runs them one by one anyway).
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"calls-{name}")
        self._closed = False

    # ----- what a kind of worker decides ------------------------------------------------
    def _launch(self) -> Address:
        raise NotImplementedError

    def _check_budget(self, cause: str) -> None:
        """Raise `WorkerDiedError` when the server may not be replaced (after `cause`)."""

    def _retire(self) -> None:
        """Let go of a server that is being replaced or closed."""

    def _died_between_calls(self) -> bool:
        """The server does not answer (a remote error still means it is there)."""
        try:
            len(self.store)
        except RpcRemoteError:
            return False
        except (NodeFailedError, DataPlaneError, WaitTimeoutError):
            return True
        return False

    # ----- the shared lifecycle ---------------------------------------------------------
    def start(self) -> Self:
        address = self._launch()
        timeout = CONNECT_TIMEOUT_S if self.connect_timeout_s is None else self.connect_timeout_s
        self._client = RpcClient(address, self.authkey, f"model worker {self.name!r}", self.call_timeout_s, timeout)
        self.store.connect(address, self.authkey)
        return self

    def _disconnect(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def _replace(self, cause: str) -> None:
        self._check_budget(cause)
        self.restarts += 1
        self._disconnect()
        self._retire()
        self.store.reset()
        self.start()

    def _call_blocking(self, request: dict[str, Any]) -> dict[str, list[Any]]:
        while True:
            client = self._client
            if self._closed or client is None:
                raise WorkerDiedError(f"model worker {self.name!r} is closed")
            try:
                infos: dict[str, list[Any]] = client.call("run", request, timeout_s=self.call_timeout_s)
                return infos
            except RpcConnectionLost as error:
                if self._closed:
                    raise WorkerDiedError(f"model worker {self.name!r} is closed") from None
                self._replace(f"died ({error})")

    async def revive(self) -> bool:
        """Restart a server that died between calls (its store is gone); True if it was restarted.

        Queued behind any call in flight, which restarts a server that dies under it itself."""
        return await asyncio.wrap_future(self._calls.submit(self._revive_blocking))

    def _revive_blocking(self) -> bool:
        if self._closed or not self._died_between_calls():
            return False
        self._replace("died")
        return True

    def _request(self, mfc: MFCDef, ids: Sequence[int], plane: DataPlane) -> dict[str, Any]:
        inputs: dict[str, Any] = {}
        for key in mfc.input_keys:
            located = plane.locate(ids, key)
            sources: list[tuple[Address | None, list[int]]] = []
            inline = True
            for store_name in located:
                store = plane.stores[store_name]
                if store is self.store:
                    sources.append((None, located[store_name]))
                    inline = False
                elif isinstance(store, RemoteTensorStore):
                    sources.append((store.address, located[store_name]))
                    inline = False
            inputs[key] = {"inline": plane.gather(ids, key)} if inline else {"from": sources}
            if not inline and sum(len(i) for _, i in sources) != len(ids):
                raise MFCExecutionError(
                    f"MFC {mfc.name!r}: key {key!r} is split between in-process and "
                    f"worker stores, which a process worker cannot fetch"
                )
        return {
            "name": mfc.name,
            "model": mfc.model_name,
            "interface": mfc.interface_type.value,
            "input_keys": list(mfc.input_keys),
            "output_keys": list(mfc.output_keys),
            "n_seqs": mfc.n_seqs,
            "ids": list(ids),
            "inputs": inputs,
        }

    async def run(self, mfc: MFCDef, ids: Sequence[int], plane: DataPlane) -> Outputs:
        future = self._calls.submit(self._call_blocking, self._request(mfc, ids, plane))
        try:
            infos = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            drop_when_done(future, self.store, ids)
            raise
        except RpcRemoteError as error:
            raise MFCExecutionError(
                f"MFC {mfc.name!r} failed on worker {self.name!r}:\n{error.remote_traceback}"
            ) from None
        except WaitTimeoutError as error:
            raise WaitTimeoutError(f"MFC {mfc.name!r} on model worker {self.name!r}: {error}") from None
        return {key: [ValueInfo(d, n) for d, n in values] for key, values in infos.items()}

    def close(self) -> None:
        self._closed = True
        self._disconnect()
        self._retire()
        self.store.reset()
        self._calls.shutdown(wait=False, cancel_futures=True)


class ProcessModelWorker(RemoteModelWorker):
    """A model worker in a child process of this one, restarted here up to `max_restarts` times."""

    def __init__(
        self,
        name: str,
        factory: InterfaceFactory,
        authkey: bytes | None = None,
        max_restarts: int = 3,
        start_timeout_s: float = 120.0,
        connect_timeout_s: float | None = None,
        call_timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        super().__init__(name, authkey, connect_timeout_s, call_timeout_s)
        self.factory = factory
        self.max_restarts = max_restarts
        self.start_timeout_s = start_timeout_s
        self.process: BaseProcess | None = None
        self._parent: Connection | None = None  # the child lives while this end is open

    def _launch(self) -> Address:
        parent, child = CONTEXT.Pipe()
        self.process = start_process(
            _child_main, (self.name, self.factory, self.authkey, child), f"model-worker-{self.name}"
        )
        child.close()
        self._parent = parent
        if not parent.poll(self.start_timeout_s):
            self.close()
            raise WorkerDiedError(f"model worker {self.name!r} did not start within {self.start_timeout_s}s")
        try:
            address = tuple(parent.recv())
        except EOFError:
            self.process.join(timeout=5)
            raise WorkerDiedError(
                f"model worker {self.name!r} died while starting (exit code {self.process.exitcode})"
            ) from None
        return (str(address[0]), int(address[1]))

    def _check_budget(self, cause: str) -> None:
        if self.restarts >= self.max_restarts:
            raise WorkerDiedError(
                f"model worker {self.name!r} {cause}; restart budget of {self.max_restarts} spent"
            ) from None

    def _died_between_calls(self) -> bool:
        return self.process is not None and not self.process.is_alive()

    def _retire(self) -> None:
        if self._parent is not None:
            self._parent.close()  # the child's cue to exit; SIGTERM follows for one busy in a call
            self._parent = None
        if self.process is not None:
            stop_processes([self.process], grace_s=5.0)
