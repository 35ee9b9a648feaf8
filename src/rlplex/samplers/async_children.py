"""What runs in the child processes of the `AsyncSampler` (`rlplex.samplers.async_`, whose
docstring draws the whole): the sampler process (`sampler_main`) and the two copiers
(`copier_main`), with the locks, semaphores and counters they share with the master."""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from rlplex.envs import EnvConfig, EnvSpaces
from rlplex.errors import RlplexError
from rlplex.samplers.parallel import ParallelSampler
from rlplex.samplers.rng import process_rng_state, set_process_rng_state
from rlplex.samplers.serial import SerialSampler
from rlplex.samplers.shared import SharedBatch, SharedBatchHandle
from rlplex.samplers.shared_arrays import SharedArrays, SharedArraysHandle

if TYPE_CHECKING:  # agents import samplers.batch; a run-time import here would be circular
    from rlplex.agents.base import AgentFactory

POLL_S = 0.2  # how often a blocked wait re-checks the stop event and the other processes
EPISODE_RING = 4096
# counters: env steps copied, batches copied, episodes completed, weight version, and the env
# steps copied past which the sampler waits before its next batch (-1: never; AsyncRl's floor)
ENV_STEPS, BATCHES, EPISODES, VERSION, LIMIT = range(5)
COPIED = 2  # slot of the generator states that go with the copied env steps (0 and 1: the halves)
ERROR_BYTES = 4096

AlgoFactory = Callable[[], Any]  # builds an object with `sampler_to_buffer(samples)`


@dataclass(frozen=True)
class SyncObjects:
    """Locks, semaphores and events; picklable only as Process arguments."""

    ready: tuple[Any, Any]
    copied: tuple[Any, Any]
    progress: Any  # Condition guarding the counters and episode ring; notified per copied batch
    weight_lock: Any
    stop: Any


def _parent_alive() -> bool:
    parent = mp.parent_process()
    return parent is None or parent.is_alive()


def _acquire_or_stop(primitive: Any, stop: Any) -> bool:
    """Block on a semaphore/lock until acquired (True) or until told to stop or orphaned (False)."""
    while not primitive.acquire(timeout=POLL_S):
        if stop.is_set() or not _parent_alive():
            return False
    return True


def _wait_until(ready: Callable[[], bool], progress: Any, stop: Any) -> bool:
    """Wait on the `progress` condition (notified when a batch is copied or the optimizer's
    allowance moves) until `ready()`; False if told to stop or orphaned meanwhile."""
    if ready():
        return True
    if not _acquire_or_stop(progress, stop):
        return False
    try:
        while not ready():
            progress.wait(timeout=POLL_S)
            if stop.is_set() or not _parent_alive():
                return False
        return True
    finally:
        progress.release()


def _my_turn(count: np.ndarray, half: int) -> bool:
    """Batch k is in half k % 2: it is this half's turn to append once the batches copied so far
    are of its parity, so the replay gets every environment's steps in order (frames kept once,
    n-step chains across batches)."""
    return int(count[BATCHES]) % 2 == half


def _allowed(count: np.ndarray) -> bool:
    """The env steps copied are within what the optimizer allows (`LIMIT`; -1: no limit)."""
    return int(count[LIMIT]) < 0 or int(count[ENV_STEPS]) <= int(count[LIMIT])


def _exit_if_stopping(stop: Any) -> None:
    if stop.is_set() or not _parent_alive():
        raise SystemExit(0)


def load_shared_weights(model: nn.Module, arrays: dict[str, np.ndarray]) -> None:
    model.load_state_dict({k: torch.from_numpy(arrays[k].copy()) for k in model.state_dict()})


@dataclass(frozen=True)
class SamplerSpec:
    """Everything the sampler process is started with (one picklable Process argument)."""

    env: EnvConfig
    batch_T: int
    batch_B: int
    n_workers: int | None  # None: sample in the sampler process; a number: in that many workers
    envpool: bool  # sample in the sampler process with EnvPool's threads
    agent_factory: AgentFactory
    spaces: EnvSpaces
    n_batches: int
    seed: int
    restore: str | None  # JSON of the generator states to continue (`progress_state`)
    halves: tuple[SharedBatchHandle, SharedBatchHandle]
    weights: SharedArraysHandle
    counters: SharedArraysHandle
    sync: SyncObjects


def sampler_main(spec: SamplerSpec) -> None:
    if spec.n_workers is not None:
        # Terminated (the master's shutdown after its grace, or the master's death): unwind, so
        # that the parallel sampler stops its workers and unlinks the shared memory it created.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    torch.set_num_threads(1)
    torch.manual_seed(spec.seed)
    counter_block = SharedArrays.attach(spec.counters)
    try:
        _sample(spec, counter_block)
    except BaseException as error:
        if isinstance(error, SystemExit | KeyboardInterrupt):
            raise
        # The master sees only an exit code: leave it the cause (e.g. which worker died).
        message = f"{type(error).__name__}: {error}".encode()[:ERROR_BYTES]
        counter_block.arrays["error"][: len(message)] = np.frombuffer(message, dtype=np.uint8)
        traceback.print_exc()
        sys.stderr.flush()
        # Locals of the failed frames (a worker's semaphore) would otherwise outlive os._exit
        # and be left to the resource tracker: release them first.
        traceback.clear_frames(error.__traceback__)
        gc.collect()
        # The sampler (and its workers) are shut down already: skip the interpreter's teardown,
        # seconds with torch loaded on a busy machine, so that the master learns at once.
        os._exit(1)


def _sample(spec: SamplerSpec, counter_block: SharedArrays) -> None:
    shared = [SharedBatch.attach(h) for h in spec.halves]
    weight_block = SharedArrays.attach(spec.weights)
    count = counter_block.arrays["counters"]
    sync = spec.sync
    agent = spec.agent_factory(spec.spaces)
    sampler: SerialSampler | ParallelSampler
    if spec.envpool:
        from rlplex.samplers.envpool_ import EnvPoolSampler

        sampler = EnvPoolSampler(spec.env, spec.batch_T, spec.batch_B)
    elif spec.n_workers is None:
        sampler = SerialSampler(spec.env, spec.batch_T, spec.batch_B)
    else:
        sampler = ParallelSampler(
            spec.env, spec.batch_T, spec.batch_B, spec.n_workers, agent_factory=spec.agent_factory
        )
    sampler.initialize(agent, seed=spec.seed, rank=0)
    if spec.restore is not None:
        state = json.loads(spec.restore)
        set_process_rng_state(state["processes"][0])
        sampler.load_state_dict({"processes": state["processes"][1:], "envs": state["envs"]})
    version = -1
    try:
        for itr in range(spec.n_batches):
            half = itr % 2
            # The waits below re-check only when they block, and with a live copier they never
            # do: without this check an orphan (no parent-death signal off Linux) would sample on.
            _exit_if_stopping(sync.stop)
            if not _acquire_or_stop(sync.copied[half], sync.stop):
                return
            # After the half is free (its batch k - 2 copied): at most batch k - 1 is in flight.
            if not _wait_until(partial(_allowed, count), sync.progress, sync.stop):
                return
            if int(count[VERSION]) != version:
                if not _acquire_or_stop(sync.weight_lock, sync.stop):
                    return
                try:
                    version = int(count[VERSION])
                    load_shared_weights(agent.model, weight_block.arrays)
                finally:
                    sync.weight_lock.release()
            batch = sampler.obtain_samples(itr)
            out = dict(shared[half].batch.arrays())
            for name, array in batch.arrays():
                np.copyto(out[name], array)
            inner = sampler.state_dict()
            streams = {"processes": [process_rng_state(), *inner["processes"]], "envs": inner["envs"]}
            _write_rng(counter_block, half, streams)
            sync.ready[half].release()
        while not sync.stop.wait(POLL_S) and _parent_alive():
            pass  # done sampling; stay alive (a live child is a healthy child) until told to stop
    finally:
        sampler.shutdown()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the cleanup short
    raise SystemExit(128 + signum)


def _write_rng(block: SharedArrays, slot: int, state: dict[str, Any]) -> None:
    payload = json.dumps(state).encode()
    target = block.arrays[f"rng{slot}"]
    if len(payload) > len(target):
        raise RlplexError(f"async sampler: generator state of {len(payload)} B exceeds its {len(target)} B slot")
    target[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    block.arrays["rng_length"][slot] = len(payload)


def copier_main(
    half: int,
    algo_factory: AlgoFactory,
    batch: SharedBatchHandle,
    replay: Any,
    counters: SharedArraysHandle,
    sync: SyncObjects,
) -> None:
    from rlplex.replays import attach_replay

    torch.set_num_threads(1)
    algo = algo_factory()
    shared = SharedBatch.attach(batch)
    buffer = attach_replay(replay)  # a prioritized one gives what it appends the top priority
    buffer.wait_check = partial(_exit_if_stopping, sync.stop)  # e.g. a killed copier holds the replay lock
    block = SharedArrays.attach(counters)
    count, ep_return, ep_length = block.arrays["counters"], block.arrays["ep_return"], block.arrays["ep_length"]
    while _acquire_or_stop(sync.ready[half], sync.stop):
        if not _wait_until(partial(_my_turn, count, half), sync.progress, sync.stop):
            return
        samples = shared.batch
        buffer.append_samples(algo.sampler_to_buffer(samples))
        returns, lengths = samples.episode_stats()
        if not _acquire_or_stop(sync.progress, sync.stop):
            return
        try:
            slots = (int(count[EPISODES]) + np.arange(len(returns))) % EPISODE_RING
            ep_return[slots], ep_length[slots] = returns, lengths
            n = int(block.arrays["rng_length"][half])
            block.arrays[f"rng{COPIED}"][:n] = block.arrays[f"rng{half}"][:n]
            block.arrays["rng_length"][COPIED] = n
            count[EPISODES] += len(returns)
            count[ENV_STEPS] += samples.T * samples.B
            count[BATCHES] += 1
            sync.progress.notify_all()
        finally:
            sync.progress.release()
        sync.copied[half].release()
