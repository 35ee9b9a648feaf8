"""Model workers in processes of their own: the model, its interface and its tensor store
live in the child; the master sends ids and locations, never tensors.

    master (executor) --call: mfc, ids, where each input lives--> worker child
    worker child --get(ids, key)--> peer worker's store server (inputs it lacks)
    worker child: interface call -> outputs into its own store -> ValueInfo per value back

Inputs held by stores in the master process (the dataset's prompts) are sent inline; all
others are fetched peer to peer. Connections are `multiprocessing.connection` on 127.0.0.1
with a per-executor HMAC key; payloads are msgpack with raw array bytes (no pickle).
Connecting has a timeout (the HMAC handshake of `Client` has none, and a stopped peer would
block forever; see `rlplex.control.rpc.connect`). A worker handle keeps one request in flight
on its connection (calls of several MFCs on one worker queue on one thread) and checks that
each reply carries its request's id.

A child that dies during a call (SIGKILL, OOM) is started again and the call is issued
again, up to `max_restarts` times, so no datapoint is lost or run twice: a call's outputs
are recorded only when it returns. Values the dead child held for other datapoints are
gone: the restart bumps the store's `incarnation`, and the executor recomputes them from
the MFC that produced them. This handle restarts its child itself; under a control-plane
job, `rlplex.dataflow.job_worker` leaves restarts to the job's restart policy.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener
from typing import Any

from rlplex.control.channel import decode_item, encode_item
from rlplex.control.rpc import connect
from rlplex.dataflow.dataplane import DataPlane, DataPlaneError, LocalTensorStore
from rlplex.dataflow.mfc import MFCDef, MFCExecutionError, ModelInterfaceType
from rlplex.dataflow.workers import Outputs, drop_when_done
from rlplex.errors import NodeFailedError, WaitTimeoutError, WorkerDiedError

CONTEXT = mp.get_context("spawn")  # forking a process that runs torch threads can deadlock
CONNECT_TIMEOUT_S = 30.0  # a live peer answers the handshake in milliseconds; a stopped one never

InterfaceFactory = Callable[[], object]
"""Builds the model interface inside the child; must be picklable (a class or a partial)."""


@dataclass(frozen=True)
class ValueInfo:
    """What the master learns of a value a process worker keeps: enough to validate it."""

    dtype: str
    ndim: int


def send(conn: Connection, message: Any) -> None:
    encoded = encode_item(message)
    buffer = bytearray(encoded.size)
    encoded.write(memoryview(buffer))
    conn.send_bytes(buffer)


def receive(conn: Connection) -> Any:
    return decode_item(memoryview(conn.recv_bytes()))


def _info(value: Any) -> list[Any]:
    dtype = getattr(value, "dtype", None)
    if dtype is not None:
        return [str(dtype), int(getattr(value, "ndim", 0))]
    return [type(value).__name__, 0]


# ----- the child ------------------------------------------------------------------------
def _serve_store(listener: Listener, store: LocalTensorStore, lock: threading.Lock) -> None:
    while True:
        try:
            conn = listener.accept()
        except OSError:
            return
        threading.Thread(target=_store_session, args=(conn, store, lock), daemon=True).start()


def _store_session(conn: Connection, store: LocalTensorStore, lock: threading.Lock) -> None:
    with conn:
        while True:
            try:
                request = receive(conn)
            except (EOFError, OSError):
                return
            with lock:
                if request["op"] == "get":
                    try:
                        reply: Any = {"values": store.get_many(request["ids"], request["key"])}
                    except DataPlaneError as error:
                        reply = {"error": str(error)}
                elif request["op"] == "drop":
                    store.drop(request["ids"])
                    reply = {"ok": True}
                else:
                    reply = {"size": len(store)}
            send(conn, reply)


class ModelServer:
    """The serving side of a model worker: the interface, its tensor store, and two listeners
    (calls from the master, `get`s from peers). Hosted by a spawned child here, and by a
    control-plane node in `rlplex.dataflow.job_worker`."""

    def __init__(self, name: str, interface: object, authkey: bytes) -> None:
        self.interface, self.authkey = interface, authkey
        self.store, self.lock = LocalTensorStore(name), threading.Lock()
        self.control = Listener(("127.0.0.1", 0), authkey=authkey)
        self.store_listener = Listener(("127.0.0.1", 0), authkey=authkey)
        threading.Thread(target=_serve_store, args=(self.store_listener, self.store, self.lock), daemon=True).start()
        self.peers: dict[str, Connection] = {}

    @property
    def addresses(self) -> tuple[tuple[str, int], tuple[str, int]]:
        control, store = self.control.address, self.store_listener.address
        return (str(control[0]), int(control[1])), (str(store[0]), int(store[1]))

    def serve_one(self) -> None:
        """Serve calls on one master connection until it closes."""
        with self.control.accept() as conn:
            while True:
                try:
                    request = receive(conn)
                except (EOFError, OSError):
                    return
                try:
                    reply = _handle_call(request, self.interface, self.store, self.lock, self.peers, self.authkey)
                except Exception as error:  # the master names the MFC and worker around this text
                    import traceback

                    reply = {"error": "".join(traceback.format_exception(error))}
                reply["rid"] = request.get("rid")
                send(conn, reply)

    def close(self) -> None:
        self.control.close()
        self.store_listener.close()


def _child_main(name: str, factory: InterfaceFactory, authkey: bytes, ready: Connection) -> None:
    import torch

    torch.set_num_threads(1)
    server = ModelServer(name, factory(), authkey)
    ready.send(server.addresses)
    server.serve_one()


def _handle_call(
    request: dict[str, Any],
    interface: object,
    store: LocalTensorStore,
    lock: threading.Lock,
    peers: dict[str, Connection],
    authkey: bytes,
) -> dict[str, Any]:
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
                with lock:
                    values = store.get_many(store_ids, key)
            else:
                values = _peer_get(peers, tuple(address), store_ids, key, authkey)
            fetched.update(zip(store_ids, values, strict=True))
        inputs[key] = [fetched[i] for i in ids]
    method = getattr(interface, mfc.interface_type.value, None)
    if method is None:
        raise MFCExecutionError(f"{type(interface).__name__} has no {mfc.interface_type.value!r} call")
    outputs: Outputs = method(mfc, inputs)
    infos: dict[str, list[Any]] = {}
    with lock:
        for key, values in outputs.items():
            if len(values) == len(ids):
                store.put_many(ids, key, values)
            infos[key] = [_info(v) for v in values]
    return {"outputs": infos}


def _peer_get(
    peers: dict[str, Connection], address: tuple[str, int], ids: list[int], key: str, authkey: bytes
) -> list[Any]:
    label = f"{address[0]}:{address[1]}"
    if label not in peers:
        peers[label] = connect(address, authkey, CONNECT_TIMEOUT_S, f"peer store {label}")
    try:
        send(peers[label], {"op": "get", "ids": ids, "key": key})
        reply = receive(peers[label])
    except (OSError, EOFError) as error:
        peers.pop(label).close()  # a dead peer's connection must not be reused
        raise DataPlaneError(f"peer store {label} is gone ({error!r}); its {key!r} values are lost") from None
    if "error" in reply:
        raise DataPlaneError(reply["error"])
    return list(reply["values"])


# ----- the master's handle --------------------------------------------------------------
class RemoteTensorStore:
    """The master's view of a child's store: drop and size over the store connection."""

    def __init__(self, name: str, connect_timeout_s: float | None = None) -> None:
        self.name = name
        self.address: tuple[str, int] | None = None
        self.incarnation = 0  # grows when the child is replaced: what the old one held is gone
        self.connect_timeout_s = connect_timeout_s
        self._conn: Connection | None = None
        self._authkey = b""
        self._lock = threading.Lock()

    def connect(self, address: tuple[str, int], authkey: bytes) -> None:
        self.address, self._authkey, self._conn = address, authkey, None

    def _request(self, message: dict[str, Any]) -> Any:
        with self._lock:
            if self.address is None:
                raise DataPlaneError(f"store {self.name!r} is not running")
            if self._conn is None:
                timeout = CONNECT_TIMEOUT_S if self.connect_timeout_s is None else self.connect_timeout_s
                self._conn = connect(self.address, self._authkey, timeout, f"store {self.name!r}")
            send(self._conn, message)
            return receive(self._conn)

    def get_many(self, ids: Sequence[int], key: str) -> list[Any]:
        reply = self._request({"op": "get", "ids": list(ids), "key": key})
        if "error" in reply:
            raise DataPlaneError(reply["error"])
        return list(reply["values"])

    def put_many(self, ids: Sequence[int], key: str, values: Sequence[Any]) -> None:
        raise DataPlaneError(f"store {self.name!r} is written only by its worker")

    def drop(self, ids: Iterable[int]) -> None:
        try:
            self._request({"op": "drop", "ids": list(ids)})
        except (OSError, EOFError, NodeFailedError, WaitTimeoutError, DataPlaneError):
            pass  # a dead or stopped worker's values are gone already (or will be with it)

    def __len__(self) -> int:
        return int(self._request({"op": "size"})["size"])

    def reset(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
            self._conn, self.address = None, None
            self.incarnation += 1


class ProcessModelWorker:
    def __init__(
        self,
        name: str,
        factory: InterfaceFactory,
        authkey: bytes | None = None,
        max_restarts: int = 3,
        start_timeout_s: float = 120.0,
        connect_timeout_s: float | None = None,
    ) -> None:
        self.name = name
        self.factory = factory
        self.authkey = authkey or os.urandom(32)
        self.max_restarts = max_restarts
        self.start_timeout_s = start_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.store = RemoteTensorStore(name, connect_timeout_s)
        self.restarts = 0
        self.process: Any = None
        self._conn: Connection | None = None
        # One thread per handle: calls of several MFCs on this worker queue here, so one
        # request is in flight on the connection at a time (two threads on one connection
        # read each other's replies).
        self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"calls-{name}")
        self._request_ids = itertools.count()
        self._closed = False

    def _connect_control(self, address: tuple[str, int]) -> None:
        timeout = CONNECT_TIMEOUT_S if self.connect_timeout_s is None else self.connect_timeout_s
        self._conn = connect(address, self.authkey, timeout, f"model worker {self.name!r}")

    def start(self) -> ProcessModelWorker:
        parent, child = CONTEXT.Pipe()
        self.process = CONTEXT.Process(
            target=_child_main,
            args=(self.name, self.factory, self.authkey, child),
            name=f"model-worker-{self.name}",
            daemon=True,
        )
        self.process.start()
        child.close()
        if not parent.poll(self.start_timeout_s):
            self.close()
            raise WorkerDiedError(f"model worker {self.name!r} did not start within {self.start_timeout_s}s")
        control_address, store_address = parent.recv()
        self._connect_control(control_address)
        self.store.connect(store_address, self.authkey)
        return self

    def _request(self, mfc: MFCDef, ids: Sequence[int], plane: DataPlane) -> dict[str, Any]:
        inputs: dict[str, Any] = {}
        for key in mfc.input_keys:
            located = plane.locate(ids, key)
            sources: list[tuple[tuple[str, int] | None, list[int]]] = []
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

    def _call_blocking(self, request: dict[str, Any]) -> dict[str, Any]:
        while True:
            if self._closed:
                raise WorkerDiedError(f"model worker {self.name!r} is closed")
            try:
                assert self._conn is not None
                send(self._conn, request)
                reply: dict[str, Any] = receive(self._conn)
                if reply.get("rid") != request["rid"]:
                    raise MFCExecutionError(
                        f"model worker {self.name!r}: reply to request {reply.get('rid')} arrived for request "
                        f"{request['rid']} (connection out of step)"
                    )
                return reply
            except (EOFError, OSError) as error:
                if self.restarts >= self.max_restarts:
                    raise WorkerDiedError(
                        f"model worker {self.name!r} died ({error!r}); restart budget of {self.max_restarts} spent"
                    ) from None
                self.restarts += 1
                self._restart()

    async def revive(self) -> bool:
        """Restart a child that died between calls (its store is gone); True if it was restarted.

        Queued behind any call in flight, which restarts a child that dies under it itself."""
        return await asyncio.wrap_future(self._calls.submit(self._revive_blocking))

    def _revive_blocking(self) -> bool:
        if self._closed or self.process is None or self.process.is_alive():
            return False
        if self.restarts >= self.max_restarts:
            raise WorkerDiedError(f"model worker {self.name!r} died; restart budget of {self.max_restarts} spent")
        self.restarts += 1
        self._restart()
        return True

    def _restart(self) -> None:
        if self.process is not None:
            self.process.join(timeout=5)
        self.store.reset()
        self.start()

    async def run(self, mfc: MFCDef, ids: Sequence[int], plane: DataPlane) -> Outputs:
        request = {**self._request(mfc, ids, plane), "rid": next(self._request_ids)}
        future = self._calls.submit(self._call_blocking, request)
        try:
            reply = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            drop_when_done(future, self.store, ids)
            raise
        if "error" in reply:
            raise MFCExecutionError(f"MFC {mfc.name!r} failed on worker {self.name!r}:\n{reply['error']}")
        return {key: [ValueInfo(d, n) for d, n in infos] for key, infos in reply["outputs"].items()}

    def close(self) -> None:
        self._closed = True
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self.process is not None:
            self.process.join(timeout=5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout=5)
        self._calls.shutdown(wait=False, cancel_futures=True)
