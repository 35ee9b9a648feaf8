"""FunctionExecutor over model workers in their own processes (tensors stay in the children)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import threading
import time
from functools import partial
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from process_interfaces import GRAPH, INF, SHARED_GRAPH, Generator, Reward, ScoreTrainer, Shared, Trainer

from rlplex.control.rpc import RpcClient
from rlplex.dataflow import DataPlane, FunctionExecutor, LocalTensorStore, MFCDef
from rlplex.dataflow.process_worker import ProcessModelWorker, RemoteTensorStore, ValueInfo
from rlplex.errors import NodeFailedError, WaitTimeoutError


@pytest.fixture
def workers(tmp_path: Path) -> Any:
    started: list[ProcessModelWorker] = []

    def make(**generator_kwargs: Any) -> dict[str, list[ProcessModelWorker]]:
        key = os.urandom(16)
        group = {
            "generator": [ProcessModelWorker(f"gen{i}", partial(Generator, **generator_kwargs), key) for i in range(2)],
            "reward": [ProcessModelWorker("rew0", Reward, key)],
            "trainer": [ProcessModelWorker("train0", partial(Trainer, str(tmp_path / "trained.txt")), key)],
        }
        for worker in itertools.chain(*group.values()):
            started.append(worker.start())
        return group

    yield make
    pids = [w.process.pid for w in started if w.process is not None]
    for worker in started:
        worker.close()
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def trained(tmp_path: Path) -> list[int]:
    return sorted(int(line) for line in (tmp_path / "trained.txt").read_text().split())


@pytest.mark.slow
def test_steps_across_processes_train_each_datapoint_once_and_free_every_store(workers: Any, tmp_path: Path) -> None:
    group = workers()
    executor = FunctionExecutor(GRAPH, group, ({"prompt": i} for i in itertools.count()), capacity=16)
    loop = asyncio.new_event_loop()
    try:
        for _ in range(3):
            loop.run_until_complete(asyncio.wait_for(executor.execute_step(), 60))
    finally:
        loop.close()
    assert trained(tmp_path) == list(range(24))
    assert executor.plane.n_values == 0
    assert all(len(w.store) == 0 for ws in group.values() for w in ws)  # asked of each child


@pytest.mark.slow
def test_generation_worker_killed_mid_call_is_restarted_and_its_call_reissued(workers: Any, tmp_path: Path) -> None:
    marker = tmp_path / "blocked_pid"
    group = workers(block_first_call_in=str(marker))
    executor = FunctionExecutor(GRAPH, group, ({"prompt": i} for i in itertools.count()), capacity=16)
    loop = asyncio.new_event_loop()
    try:
        step = loop.create_task(asyncio.wait_for(executor.execute_step(), 90))
        loop.run_until_complete(asyncio.sleep(0))
        # Let the step run until a generator is inside its first call, then kill that process.
        while not marker.exists() or not marker.read_text():
            loop.run_until_complete(asyncio.wait([step], timeout=0.05))
            assert not step.done(), step.exception()
        victim = int(marker.read_text())
        os.kill(victim, signal.SIGKILL)
        loop.run_until_complete(step)
    finally:
        loop.close()
    assert sum(w.restarts for w in group["generator"]) == 1
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE
    assert trained(tmp_path) == list(range(8))  # nothing lost, nothing trained twice


# ----- issue 17 ----------------------------------------------------------------------------
def run_steps(executor: FunctionExecutor, steps: int, timeout: float = 60) -> None:
    loop = asyncio.new_event_loop()
    try:
        for _ in range(steps):
            loop.run_until_complete(asyncio.wait_for(executor.execute_step(), timeout))
    finally:
        loop.close()


def test_two_mfcs_on_one_process_worker_get_their_own_replies(tmp_path: Path) -> None:
    key = os.urandom(16)
    group = {
        "shared": [ProcessModelWorker("shared0", Shared, key)],
        "trainer": [ProcessModelWorker("train0", partial(ScoreTrainer, str(tmp_path / "trained.txt")), key)],
    }
    started = [w.start() for ws in group.values() for w in ws]
    try:
        executor = FunctionExecutor(SHARED_GRAPH, group, ({"prompt": i} for i in itertools.count()), capacity=16)
        run_steps(executor, 3)
    finally:
        for worker in started:
            worker.close()
    assert trained(tmp_path) == list(range(24))  # each seq met its own score
    assert executor.plane.n_values == 0


def test_store_connect_gives_up_on_a_peer_that_never_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlplex.dataflow import process_worker

    monkeypatch.setattr(process_worker, "CONNECT_TIMEOUT_S", 0.3, raising=False)
    silent = Listener(("127.0.0.1", 0), authkey=b"k")  # accepts TCP, never runs the handshake
    store = process_worker.RemoteTensorStore("silent")
    store.connect(silent.address, b"k")
    outcome: list[BaseException] = []

    def ask() -> None:
        try:
            len(store)
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(10)  # a connect with no timeout would block here for ever
    silent.close()
    assert not thread.is_alive() and isinstance(outcome[0], WaitTimeoutError), outcome


@pytest.mark.slow
def test_outputs_lost_with_a_killed_worker_are_recomputed_and_the_run_goes_on(workers: Any, tmp_path: Path) -> None:
    marker = tmp_path / "blocked_pid"
    # A generator is killed in its second call, holding the sequences of its first.
    group = workers(block_first_call_in=str(marker), block_on_call=2)
    executor = FunctionExecutor(GRAPH, group, ({"prompt": i} for i in itertools.count()), capacity=16)
    loop = asyncio.new_event_loop()
    try:
        step = loop.create_task(asyncio.wait_for(executor.execute_step(), 90))
        while not marker.exists() or not marker.read_text():
            loop.run_until_complete(asyncio.wait([step], timeout=0.05))
            assert not step.done(), step.exception()
        os.kill(int(marker.read_text()), signal.SIGKILL)
        loop.run_until_complete(step)
        loop.run_until_complete(asyncio.wait_for(executor.execute_step(), 60))  # the run goes on
    finally:
        loop.close()
    assert sum(w.restarts for w in group["generator"]) == 1
    assert executor.recomputed >= 2  # the victim's first-call sequences (and their rewards)
    assert trained(tmp_path) == list(range(16))  # nothing lost, nothing trained twice
    assert executor.plane.n_values == 0 and all(len(w.store) == 0 for ws in group.values() for w in ws)


# ----- issues 16 and 18: the model worker speaks the control plane's RPC ----------------------
REWARD = MFCDef("rew", "reward", INF, ("seq",), ("reward",), 2)


def seq_plane(worker: ProcessModelWorker, n: int) -> DataPlane:
    """Sequences 0..n-1 held in this process (sent inline), and the worker's store."""
    data = LocalTensorStore("data")
    data.put_many(list(range(n)), "seq", [np.arange(i + 1, dtype=np.int64) for i in range(n)])
    plane = DataPlane([data, worker.store])
    plane.record("data", list(range(n)), ["seq"])
    return plane


def run_reward(worker: ProcessModelWorker, plane: DataPlane, ids: list[int]) -> dict[str, list[Any]]:
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(worker.run(REWARD, ids, plane))
    finally:
        loop.close()


def test_idle_garbage_and_wrong_key_clients_do_not_block_a_model_worker() -> None:
    key = os.urandom(16)
    worker = ProcessModelWorker("rew0", Reward, key).start()
    socks: list[socket.socket] = []
    try:
        address = worker.store.address
        assert address is not None
        plane = seq_plane(worker, 4)
        for garbage in (b"", b"GET / HTTP/1.1\r\n\r\n", b"\x00\x00\x00\x10not a handshake"):
            socks.append(socket.create_connection(address, timeout=5.0))
            socks[-1].sendall(garbage)  # b"": an idle client that connected and says nothing
        with pytest.raises(NodeFailedError, match=r"cannot connect to intruder at 127\.0\.0\.1:\d+: .*(digest|Auth)"):
            RpcClient(address, b"not the key", "intruder", connect_timeout_s=5.0)
        start = time.monotonic()
        outputs = run_reward(worker, plane, [0, 1])  # the connection opened at start
        fresh = RemoteTensorStore("rew0-view")  # a new connection: its handshake queues behind nobody
        fresh.connect(address, key)
        assert len(fresh) == 2
        took = time.monotonic() - start
        assert outputs == {"reward": [ValueInfo("float32", 0)] * 2}
        assert took < 1.0, f"a call and a new connection took {took:.2f} s with idle clients connected"
    finally:
        for sock in socks:
            sock.close()
        worker.close()


def test_a_call_to_a_hung_worker_times_out_naming_it_and_the_next_call_gets_its_own_reply() -> None:
    worker = ProcessModelWorker("rew0", Reward, os.urandom(16), call_timeout_s=1.0).start()
    pid = worker.process.pid
    try:
        plane = seq_plane(worker, 4)
        os.kill(pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(WaitTimeoutError, match=r"MFC 'rew' on model worker 'rew0': .*no reply within 1 s"):
                run_reward(worker, plane, [0, 1])
            assert time.monotonic() - start < 5.0
        finally:
            os.kill(pid, signal.SIGCONT)
        # Resumed, the worker answers the timed-out call late; the next call skips that reply.
        assert run_reward(worker, plane, [2, 3]) == {"reward": [ValueInfo("float32", 0)] * 2}
        assert worker.restarts == 0 and len(worker.store) == 4
    finally:
        worker.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_store_at_a_dead_address_fails_at_once_naming_it() -> None:
    with socket.socket() as probe:  # a port nobody listens on once this closes
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()
    store = RemoteTensorStore("gone", connect_timeout_s=2.0)
    store.connect(dead, b"k")
    start = time.monotonic()
    with pytest.raises(NodeFailedError, match=r"cannot connect to store 'gone' at 127\.0\.0\.1:\d+: .*refused"):
        len(store)
    assert time.monotonic() - start < 4.0
