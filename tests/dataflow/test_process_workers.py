"""FunctionExecutor over model workers in their own processes (tensors stay in the children)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import threading
from functools import partial
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import psutil
import pytest
from process_interfaces import GRAPH, SHARED_GRAPH, Generator, Reward, ScoreTrainer, Shared, Trainer

from rlplex.dataflow import FunctionExecutor
from rlplex.dataflow.process_worker import ProcessModelWorker
from rlplex.errors import WaitTimeoutError


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
