"""The asynchronous sampler of `AsyncRl`: a sampler process, a double buffer, memory copiers.

```
 sampler process (SerialSampler, own agent copy)          master (optimizer)
   wait copied[h] -> pull weights if version changed         publishes weights + version
   -> obtain_samples -> write half h -> release ready[h]        ^
 copier h (one per half)                                         |  waits on `progress` (Condition)
   wait ready[h] -> algo.sampler_to_buffer(half h)               |
   -> replay.append_samples (replay lock) -> env_steps += T*B ---+ notify_all
   -> release copied[h]
```

With `n_workers` given, the sampler process runs a `ParallelSampler` instead of a
`SerialSampler`: its worker processes step the environments and run the agent, the sampler
process hands each batch over to a half (a copy of [T, B] arrays, microseconds beside the
stepping) and does the double buffer's bookkeeping. A worker that dies ends the sampler
process, which writes the worker's error where the master reads it (`check_alive`).

Random streams: after each batch the sampler process writes its generator states (its own,
its workers', its environments'; `rlplex.samplers.rng`) beside the half; the copier moves them
to the "copied" slot in the same critical section that counts the batch, so the master reads
the env-step count and the states that belong together (`progress_state`). A resumed sampler
starts from them: it continues the streams rather than repeating the run's seeds.

Backpressure: the sampler blocks only when both halves wait to be copied (copying is
fast); the copiers block only on the replay lock. The optimizer never slows the sampler;
it slows itself (the replay-ratio throttle in `rlplex.runners.async_`).

The copiers build their own algorithm object from a picklable factory and call only its
`sampler_to_buffer()`: like rlpyt's copier, they do not see attribute changes made later to
the master's algorithm object.

Every blocking wait has a timeout: children re-check a stop event and whether their parent
still lives, and the master checks its children. A killed master leaves no orphan: on Linux
its children are SIGTERMed by the kernel at once (`die_with_launcher`), elsewhere the sampler
notices within a batch and the copiers within `POLL_S` of it.
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.context import SpawnProcess
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from rlplex.envs import EnvConfig, EnvSpaces
from rlplex.errors import ConfigError, RlplexError, WaitTimeoutError, WorkerDiedError
from rlplex.samplers.parallel import RNG_SLOT_BYTES, RNG_SLOT_BYTES_PER_ENV, ParallelSampler
from rlplex.samplers.processes import CONTEXT, check_alive, die_with_launcher, start_process, stop_processes
from rlplex.samplers.rng import process_rng_state, set_process_rng_state
from rlplex.samplers.serial import SerialSampler
from rlplex.samplers.shared import SharedBatch, SharedBatchHandle
from rlplex.samplers.shared_arrays import SharedArrays, SharedArraysHandle

if TYPE_CHECKING:  # agents import samplers.batch; a run-time import here would be circular
    from rlplex.agents.base import AgentFactory

POLL_S = 0.2  # how often a blocked wait re-checks the stop event and the other processes
LOCK_TIMEOUT_S = 30.0
EPISODE_RING = 4096
# counters: env steps copied, batches copied, episodes completed, weight version
ENV_STEPS, BATCHES, EPISODES, VERSION = range(4)
COPIED = 2  # slot of the generator states that go with the copied env steps (0 and 1: the halves)
ERROR_BYTES = 4096

BufferSelector = Callable[[Any], dict[str, np.ndarray]]
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


def _exit_if_stopping(stop: Any) -> None:
    if stop.is_set() or not _parent_alive():
        raise SystemExit(0)


def load_shared_weights(model: nn.Module, arrays: dict[str, np.ndarray]) -> None:
    model.load_state_dict({k: torch.from_numpy(arrays[k].copy()) for k in model.state_dict()})


def sampler_main(
    env: EnvConfig,
    batch_T: int,
    batch_B: int,
    n_workers: int | None,
    agent_factory: AgentFactory,
    spaces: EnvSpaces,
    n_batches: int,
    seed: int,
    restore: str | None,
    halves: tuple[SharedBatchHandle, SharedBatchHandle],
    weights: SharedArraysHandle,
    counters: SharedArraysHandle,
    sync: SyncObjects,
) -> None:
    die_with_launcher()
    if n_workers is not None:
        # Terminated (the master's shutdown after its grace, or the master's death): unwind, so
        # that the parallel sampler stops its workers and unlinks the shared memory it created.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    counter_block = SharedArrays.attach(counters)
    try:
        _sample(
            env,
            batch_T,
            batch_B,
            n_workers,
            agent_factory,
            spaces,
            n_batches,
            seed,
            restore,
            halves,
            weights,
            counter_block,
            sync,
        )
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


def _sample(
    env: EnvConfig,
    batch_T: int,
    batch_B: int,
    n_workers: int | None,
    agent_factory: AgentFactory,
    spaces: EnvSpaces,
    n_batches: int,
    seed: int,
    restore: str | None,
    halves: tuple[SharedBatchHandle, SharedBatchHandle],
    weights: SharedArraysHandle,
    counter_block: SharedArrays,
    sync: SyncObjects,
) -> None:
    shared = [SharedBatch.attach(h) for h in halves]
    weight_block = SharedArrays.attach(weights)
    count = counter_block.arrays["counters"]
    agent = agent_factory(spaces)
    sampler: SerialSampler | ParallelSampler
    if n_workers is None:
        sampler = SerialSampler(env, batch_T, batch_B)
    else:
        sampler = ParallelSampler(env, batch_T, batch_B, n_workers, agent_factory=agent_factory)
    sampler.initialize(agent, seed=seed, rank=0)
    if restore is not None:
        state = json.loads(restore)
        set_process_rng_state(state["processes"][0])
        sampler.load_state_dict({"processes": state["processes"][1:], "envs": state["envs"]})
    version = -1
    try:
        for itr in range(n_batches):
            half = itr % 2
            # The waits below re-check only when they block, and with a live copier they never
            # do: without this check an orphan (no parent-death signal off Linux) would sample on.
            _exit_if_stopping(sync.stop)
            if not _acquire_or_stop(sync.copied[half], sync.stop):
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
    die_with_launcher()
    from rlplex.replays import attach_replay

    torch.set_num_threads(1)
    algo = algo_factory()
    shared = SharedBatch.attach(batch)
    buffer = attach_replay(replay)  # a prioritized one gives what it appends the top priority
    buffer.wait_check = partial(_exit_if_stopping, sync.stop)  # e.g. a killed copier holds the replay lock
    block = SharedArrays.attach(counters)
    count, ep_return, ep_length = block.arrays["counters"], block.arrays["ep_return"], block.arrays["ep_length"]
    while _acquire_or_stop(sync.ready[half], sync.stop):
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


def _semaphore_names(obj: Any) -> list[str]:
    """Names of the POSIX semaphores inside a multiprocessing Lock/Semaphore/Condition/Event."""
    if hasattr(obj, "_semlock"):
        return [str(obj._semlock.name)]
    if type(obj).__module__ != "multiprocessing.synchronize":
        return []
    return [name for value in vars(obj).values() for name in _semaphore_names(value)]


class AsyncSampler:
    """Master-side owner of the sampler and copier processes and of their shared memory."""

    def __init__(self, env: EnvConfig, batch_T: int, batch_B: int, n_workers: int | None = None) -> None:
        """`n_workers`: None samples in the sampler process itself; a number, in that many
        worker processes behind it (`ParallelSampler`)."""
        if n_workers is not None and not 1 <= n_workers <= batch_B:
            raise ConfigError(
                f"field 'sampler.n_workers': {n_workers} workers need 1 <= n_workers <= batch_B ({batch_B})"
            )
        self.env_config, self.batch_T, self.batch_B, self.n_workers = env, batch_T, batch_B, n_workers
        self.processes: list[SpawnProcess] = []
        self._owned: list[Any] = []
        self._episodes_read = 0

    def start(
        self,
        agent_factory: AgentFactory,
        spaces: EnvSpaces,
        model: nn.Module,
        algo_factory: AlgoFactory,
        replay_handle: Any,
        n_batches: int,
        seed: int,
        start_env_steps: int = 0,
        restore: dict[str, Any] | None = None,
    ) -> None:
        """`restore`: generator states from `progress_state()` of an earlier run to continue."""
        try:
            restored = None if restore is None else json.dumps(restore)
            args = (agent_factory, spaces, model, algo_factory, replay_handle, n_batches, seed, start_env_steps)
            self._start(*args, restored)
        except BaseException:
            self.shutdown()
            raise

    def _start(
        self,
        agent_factory: AgentFactory,
        spaces: EnvSpaces,
        model: nn.Module,
        algo_factory: AlgoFactory,
        replay_handle: Any,
        n_batches: int,
        seed: int,
        start_env_steps: int,
        restore: str | None,
    ) -> None:
        info_spec = agent_factory(spaces).info_spec
        halves = [SharedBatch.create(spaces, info_spec, self.batch_T, self.batch_B) for _ in range(2)]
        self._owned += halves
        state = model.state_dict()
        self._weights = SharedArrays.create(
            {k: (tuple(v.shape), torch.empty((), dtype=v.dtype).numpy().dtype) for k, v in state.items()}
        )
        self._owned.append(self._weights)
        n_processes = 1 + (self.n_workers or 0)
        rng_bytes = RNG_SLOT_BYTES * n_processes + RNG_SLOT_BYTES_PER_ENV * self.batch_B
        self._stats = SharedArrays.create(
            {
                "counters": ((4,), np.int64),
                "ep_return": ((EPISODE_RING,), np.float64),
                "ep_length": ((EPISODE_RING,), np.int64),
                "rng_length": ((3,), np.int64),
                **{f"rng{slot}": ((rng_bytes,), np.uint8) for slot in range(3)},
                "error": ((ERROR_BYTES,), np.uint8),
            }
        )
        self._owned.append(self._stats)
        self._count = self._stats.arrays["counters"]
        self._count[ENV_STEPS] = start_env_steps
        self.sync = SyncObjects(
            ready=(CONTEXT.Semaphore(0), CONTEXT.Semaphore(0)),
            copied=(CONTEXT.Semaphore(1), CONTEXT.Semaphore(1)),
            progress=CONTEXT.Condition(CONTEXT.Lock()),
            weight_lock=CONTEXT.Lock(),
            stop=CONTEXT.Event(),
        )
        self.publish_weights(model)
        handles = (halves[0].handle, halves[1].handle)
        self.processes.append(
            start_process(
                sampler_main,
                (
                    self.env_config,
                    self.batch_T,
                    self.batch_B,
                    self.n_workers,
                    agent_factory,
                    spaces,
                    n_batches,
                    seed,
                    restore,
                    handles,
                    self._weights.handle,
                    self._stats.handle,
                    self.sync,
                ),
                name="async-sampler",
                daemon=self.n_workers is None,  # a parallel sampler starts worker processes
            )
        )
        for half in range(2):
            self.processes.append(
                start_process(
                    copier_main,
                    (half, algo_factory, handles[half], replay_handle, self._stats.handle, self.sync),
                    name=f"async-copier-{half}",
                )
            )

    # ----- master side ----------------------------------------------------------------------
    def shared_names(self) -> list[str]:
        """Names under /dev/shm of every segment and semaphore this sampler created (for leak checks)."""
        names = [name for block in self._owned for _, name, _, _ in block.handle.arrays]
        sync = self.__dict__.get("sync")
        if sync is not None:
            prims = [*sync.ready, *sync.copied, sync.weight_lock, sync.progress, sync.stop]
            names += ["sem." + name.lstrip("/") for p in prims for name in _semaphore_names(p)]
        return names

    def check_alive(self) -> None:
        try:
            check_alive(self.processes)
        except WorkerDiedError as error:
            cause = bytes(self._stats.arrays["error"]).rstrip(b"\0").decode(errors="replace")
            if cause:
                raise WorkerDiedError(f"{error}: {cause}") from None
            raise

    def progress_state(self) -> tuple[int, dict[str, Any] | None]:
        """The env steps copied so far and the sampler's generator states right after the
        batch that completed them, read together (None before the first batch is copied)."""
        self._acquire(self.sync.progress, "progress condition")
        try:
            env_steps, n = int(self._count[ENV_STEPS]), int(self._stats.arrays["rng_length"][COPIED])
            state = json.loads(self._stats.arrays[f"rng{COPIED}"][:n].tobytes()) if n else None
            return env_steps, state
        finally:
            self.sync.progress.release()

    def _acquire(self, primitive: Any, what: str) -> None:
        waited = 0.0
        while not primitive.acquire(timeout=POLL_S):
            self.check_alive()  # a child killed while holding it shows up here as WorkerDiedError
            waited += POLL_S
            if waited >= LOCK_TIMEOUT_S:
                raise WaitTimeoutError(f"AsyncSampler: {what} not acquired within {LOCK_TIMEOUT_S} s")

    @property
    def env_steps(self) -> int:
        return int(self._count[ENV_STEPS])

    @property
    def batches(self) -> int:
        return int(self._count[BATCHES])

    def wait_for_steps(self, threshold: int, timeout: float) -> bool:
        """Block until `threshold` env steps are copied or `timeout` passes; True if reached."""
        self._acquire(self.sync.progress, "progress condition")
        try:
            return bool(self.sync.progress.wait_for(lambda: self._count[ENV_STEPS] >= threshold, timeout))
        finally:
            self.sync.progress.release()

    def new_episodes(self) -> tuple[np.ndarray, np.ndarray]:
        """Returns and lengths of episodes copied since the last call (at most the ring's size)."""
        self._acquire(self.sync.progress, "progress condition")
        try:
            total = int(self._count[EPISODES])
            start = max(self._episodes_read, total - EPISODE_RING)
            slots = np.arange(start, total) % EPISODE_RING
            self._episodes_read = total
            arrays = self._stats.arrays
            return arrays["ep_return"][slots].copy(), arrays["ep_length"][slots].copy()
        finally:
            self.sync.progress.release()

    def publish_weights(self, model: nn.Module) -> None:
        self._acquire(self.sync.weight_lock, "weight lock")
        try:
            with torch.no_grad():
                for key, value in model.state_dict().items():
                    # from_numpy shares the segment's memory: one copy, device to host where the
                    # model is on a GPU, with no intermediate array.
                    torch.from_numpy(self._weights.arrays[key]).copy_(value.detach())
            self._count[VERSION] += 1
        finally:
            self.sync.weight_lock.release()

    def shutdown(self) -> None:
        if hasattr(self, "sync"):
            self.sync.stop.set()
        # Children notice `stop` within POLL_S; one stuck on a lock that a killed child held
        # never will, so after a short grace everything left is terminated. A parallel sampler
        # process first finishes its batch and stops its workers (ParallelSampler.shutdown).
        now = time.monotonic()
        deadlines = [now + 2 * POLL_S + 0.2 + (5.0 if p.name == "async-sampler" and self.n_workers else 0.0)
                     for p in self.processes]  # fmt: skip
        for process, deadline in zip(self.processes, deadlines, strict=True):
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        stop_processes(self.processes)
        self.processes = []
        # Named semaphores are unlinked when their last reference goes: drop ours now.
        self.__dict__.pop("sync", None)
        for block in self._owned:
            block.close()
        self._owned = []
