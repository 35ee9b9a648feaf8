"""The asynchronous sampler of `AsyncRl`: a sampler process, a double buffer, memory copiers.

```
 sampler process (SerialSampler, own agent copy)          master (optimizer)
   wait copied[h] -> pull weights if version changed         publishes weights + version
   -> obtain_samples -> write half h -> release ready[h]        ^
 copier h (one per half)                                         |  waits on `progress` (Condition)
   wait ready[h] -> wait for its turn -> sampler_to_buffer(h)    |
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

Order: batch k is written to half k % 2, and its copier appends it only once batch k - 1 has
been appended (its turn: the copied-batch count has its parity), so the replay receives each
environment's steps in order, as in a single process: frame stacks can be kept one frame a
step and n-step returns run across batches.

Backpressure: the sampler blocks only when both halves wait to be copied (copying is
fast); the copiers block only on the replay lock and on their turn, which comes as soon as
the other copier has appended the batch sampled before. The optimizer never slows the sampler;
it slows itself (the replay-ratio throttle in `rlplex.runners.async_`).

The copiers build their own algorithm object from a picklable factory and call only its
`sampler_to_buffer()`: like rlpyt's copier, they do not see attribute changes made later to
the master's algorithm object.

Every blocking wait has a timeout: children re-check a stop event and whether their parent
still lives, and the master checks its children. A killed master leaves no orphan: on Linux
its children are SIGTERMed by the kernel at once (`start_process`), elsewhere the sampler
notices within a batch and the copiers within `POLL_S` of it.
"""

from __future__ import annotations

import json
import time
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from rlplex.envs import EnvConfig, EnvSpaces
from rlplex.errors import ConfigError, WorkerDiedError
from rlplex.io.shm_sync import acquire_polling
from rlplex.processes import CONTEXT, check_alive, start_process, stop_processes
from rlplex.samplers.async_children import (
    BATCHES,
    COPIED,
    ENV_STEPS,
    EPISODE_RING,
    EPISODES,
    ERROR_BYTES,
    LIMIT,
    POLL_S,
    VERSION,
    AlgoFactory,
    SamplerSpec,
    SyncObjects,
    copier_main,
    sampler_main,
)
from rlplex.samplers.parallel import RNG_SLOT_BYTES, RNG_SLOT_BYTES_PER_ENV
from rlplex.samplers.shared import SharedBatch
from rlplex.samplers.shared_arrays import SharedArrays

if TYPE_CHECKING:  # agents import samplers.batch; a run-time import here would be circular
    from rlplex.agents.base import AgentFactory

LOCK_TIMEOUT_S = 30.0
__all__ = ["POLL_S", "AsyncSampler"]


def _semaphore_names(obj: Any) -> list[str]:
    """Names of the POSIX semaphores inside a multiprocessing Lock/Semaphore/Condition/Event."""
    if hasattr(obj, "_semlock"):
        return [str(obj._semlock.name)]
    if type(obj).__module__ != "multiprocessing.synchronize":
        return []
    return [name for value in vars(obj).values() for name in _semaphore_names(value)]


class AsyncSampler:
    """Master-side owner of the sampler and copier processes and of their shared memory."""

    def __init__(
        self, env: EnvConfig, batch_T: int, batch_B: int, n_workers: int | None = None, envpool: bool = False
    ) -> None:
        """`n_workers`: None samples in the sampler process itself; a number, in that many
        worker processes behind it (`ParallelSampler`). `envpool`: the sampler process steps
        its environments on EnvPool's threads (`EnvPoolSampler`; no worker processes)."""
        if envpool and n_workers is not None:
            raise ConfigError("AsyncSampler: envpool steps the environments itself; give no n_workers")
        if n_workers is not None and not 1 <= n_workers <= batch_B:
            raise ConfigError(
                f"field 'sampler.n_workers': {n_workers} workers need 1 <= n_workers <= batch_B ({batch_B})"
            )
        self.env_config, self.batch_T, self.batch_B, self.n_workers = env, batch_T, batch_B, n_workers
        self.envpool = envpool
        self.processes: list[BaseProcess] = []
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
                "counters": ((5,), np.int64),
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
        self._count[LIMIT] = -1
        self.sync = SyncObjects(
            ready=(CONTEXT.Semaphore(0), CONTEXT.Semaphore(0)),
            copied=(CONTEXT.Semaphore(1), CONTEXT.Semaphore(1)),
            progress=CONTEXT.Condition(CONTEXT.Lock()),
            weight_lock=CONTEXT.Lock(),
            stop=CONTEXT.Event(),
        )
        self.publish_weights(model)
        handles = (halves[0].handle, halves[1].handle)
        spec = SamplerSpec(
            self.env_config,
            self.batch_T,
            self.batch_B,
            self.n_workers,
            self.envpool,
            agent_factory,
            spaces,
            n_batches,
            seed,
            restore,
            handles,
            self._weights.handle,
            self._stats.handle,
            self.sync,
        )
        self.processes.append(
            start_process(
                sampler_main,
                (spec,),
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
        # A child killed while holding it shows up in check_alive as WorkerDiedError.
        acquire_polling(primitive, self.check_alive, f"AsyncSampler: {what}", LOCK_TIMEOUT_S)

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

    def limit_sampling(self, env_steps: int) -> None:
        """The sampler starts no batch while more than `env_steps` are copied (-1: no limit)."""
        if int(self._count[LIMIT]) == env_steps:
            return
        self._acquire(self.sync.progress, "progress condition")
        try:
            self._count[LIMIT] = env_steps
            self.sync.progress.notify_all()
        finally:
            self.sync.progress.release()

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
