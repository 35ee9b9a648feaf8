"""FunctionExecutor over model workers in their own processes (tensors stay in the children)."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import pytest
from process_interfaces import GRAPH, Generator, Reward, Trainer

from rlplex.dataflow import FunctionExecutor
from rlplex.dataflow.process_worker import ProcessModelWorker


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
