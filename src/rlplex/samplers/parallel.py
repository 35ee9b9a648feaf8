"""`ParallelSampler`: CPU worker processes step environments AND run the agent, writing one
shared-memory batch.

    master (learner)                      worker w  (owns envs [start_w, stop_w))
    ----------------                      ----------------------------------------
    obtain_samples(itr):
      weights.write(model.state_dict())   (idle, waiting on go[w])
      -> version += 1 if changed
      go[w].release()  for every w  --->  reload weights if version moved
                                          EnvCollector.collect(agent.step, batch[:, start_w:stop_w])
      done[w].acquire() for every w <---  done[w].release()
      return the shared batch view

Where inference runs, and why: in the workers, each with its own copy of the agent built
from the picklable `AgentFactory`. With inference in the master, every time step would need
a round trip (observations in, actions out) between master and workers; here master and
workers meet once per batch (`batch_T` steps). On a 2-core machine one small-MLP policy call
cost about 280 µs against about 49 µs for a 4-env CartPole step, and CartPole ran at about
117k steps/s in one process but 8–11k steps/s through subprocess vector envs, which pay a
pipe round trip per step (LESSONS.md, rlpyt). Each worker batches its own environments into
one policy call per step, and no per-step synchronisation is left. The cost: a worker's copy
of the weights is as old as the start of the batch, which is exactly on-policy for a
synchronous runner (the learner is idle while the batch is collected).

When to prefer `SerialSampler`: each worker pays its own policy call per step, so n workers
make n calls where one process makes one. That pays off only with a free core per worker;
in benchmarks/sampler_throughput.py (16 CartPole envs, 64x64 MLP agent, 2 cores) two
workers stepped about 128k steps/s against the serial sampler's 60-90k when the cores were
free, but about 33k against 59k when other jobs kept them busy (load average 6-14). Both
stayed ahead of subprocess vector envs (12-15k) either way.

Weights travel through `SharedWeights` (the `state_dict`, parameters and buffers, in one
shared segment, with a version counter); each worker reloads only when the version moved.

Random streams: after each batch a worker writes its generator states (its process's, for
action sampling, and its environments') as JSON into its slot of a shared block, so
`state_dict()` reads them without a round trip; `load_state_dict()` writes states into the
workers' other slots, and each restores them before its next batch (see `rlplex.samplers.rng`).

Faults: every wait polls with a short timeout and checks that the workers are alive, so a
worker killed with SIGKILL becomes `WorkerDiedError` (naming rank, worker index, pid and
exit code) within about `POLL_S`. The sampler then stops cleanly rather than restarting the
worker: it kills the other workers, unlinks its shared memory and raises. A restarted worker
would silently change the run (new environment episodes, a different random stream), and the
runner's last snapshot, written before this batch, stays intact for a resume. Workers also
exit on their own if the master disappears (their parent pid changes).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event, Semaphore
from typing import Any

import numpy as np
import torch

from rlplex.agents.base import Agent, AgentFactory, state_reset_of
from rlplex.envs import EnvConfig, EnvSpaces, env_seed, make_env, probe_spaces
from rlplex.errors import ConfigError, RlplexError, SnapshotError, WaitTimeoutError
from rlplex.models import unwrap_model
from rlplex.processes import CONTEXT, check_alive, orphaned, start_process, stop_processes
from rlplex.samplers.batch import SampleBatch
from rlplex.samplers.collector import EnvCollector
from rlplex.samplers.rng import fit_env_states, process_rng_state, set_process_rng_state, streams_digest
from rlplex.samplers.shared import SharedBatch, SharedBatchHandle
from rlplex.samplers.shared_arrays import SharedArrays, SharedArraysHandle
from rlplex.samplers.weights import SharedWeights, SharedWeightsHandle

POLL_S = 0.1  # how often a waiting side checks the other side's liveness
# A process's generator states take about 23 kB of JSON, an environment's about 150 B.
RNG_SLOT_BYTES, RNG_SLOT_BYTES_PER_ENV = 64 << 10, 512
SAVED, TO_LOAD = 0, 1  # columns of the "lengths" array: bytes of JSON in each of a worker's slots


@dataclass(frozen=True)
class _WorkerSpec:
    """Everything a worker needs, picklable under `spawn`."""

    index: int
    env: EnvConfig
    spaces: EnvSpaces
    agent_factory: AgentFactory
    batch: SharedBatchHandle
    weights: SharedWeightsHandle
    env_start: int
    env_stop: int
    seeds: tuple[int, ...]
    rng_seed: int  # the worker's torch and numpy generators (action sampling)
    rng: SharedArraysHandle  # "lengths" [n_workers, 2], and per worker "save{w}" / "load{w}" bytes


@dataclass(frozen=True)
class _PickledAgent:
    """Fallback factory when none is given: the worker gets a copy of the master's agent."""

    agent: Any

    def __call__(self, spaces: EnvSpaces) -> Agent:
        agent: Agent = self.agent
        return agent


def split_envs(batch_B: int, n_workers: int) -> list[tuple[int, int]]:
    """[start, stop) env ranges per worker; the first `batch_B % n_workers` get one more."""
    base, extra = divmod(batch_B, n_workers)
    ranges, start = [], 0
    for w in range(n_workers):
        stop = start + base + (1 if w < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


def worker_rng_seed(seed: int, rank: int, worker: int) -> int:
    """Seed of a worker's action sampling: reproducible per run, distinct per (rank, worker).

    A two-part spawn key: a stream apart from the environment seeds (three-part keys, `env_seed`).
    """
    sequence = np.random.SeedSequence(entropy=seed, spawn_key=(rank, worker))
    return int(sequence.generate_state(1, dtype=np.uint32)[0])


class ParallelSampler:
    """`batch_B` environments split over `n_workers` processes; see the module docstring.

    `agent_factory` builds each worker's agent (it must be picklable: a class or a
    `functools.partial`); without it the master's agent is pickled to the workers once.
    `startup_timeout_s` bounds worker start-up (importing torch, making envs);
    `batch_timeout_s` bounds one batch.
    """

    def __init__(
        self,
        env: EnvConfig,
        batch_T: int,
        batch_B: int,
        n_workers: int = 2,
        agent_factory: AgentFactory | None = None,
        startup_timeout_s: float = 300.0,
        batch_timeout_s: float = 600.0,
    ) -> None:
        if n_workers < 1 or batch_B < n_workers:
            raise ConfigError(
                f"field 'sampler.n_workers': {n_workers} workers need 1 <= n_workers <= batch_B ({batch_B})"
            )
        self.env_config = env
        self.batch_T = batch_T
        self.batch_B = batch_B
        self.n_workers = n_workers
        self.agent_factory = agent_factory
        self.startup_timeout_s = startup_timeout_s
        self.batch_timeout_s = batch_timeout_s
        self.env_seeds: list[tuple[int, ...]] = []  # per worker, set by initialize
        self.processes: list[BaseProcess] = []
        self._agent: Agent | None = None
        self._shared: SharedBatch | None = None
        self._weights: SharedWeights | None = None
        self._go: list[Semaphore] = []
        self._done: list[Semaphore] = []
        self._stop: Event | None = None
        self._rng: SharedArrays | None = None
        self._ranges: list[tuple[int, int]] = []
        self._rank = 0

    # ----- lifecycle ----------------------------------------------------------------------
    def initialize(self, agent: Agent, seed: int, rank: int = 0) -> None:
        if self.processes:
            raise RlplexError("ParallelSampler.initialize called twice; call shutdown() first")
        self._agent, self._rank = agent, rank
        spaces = probe_spaces(self.env_config)
        factory = self.agent_factory if self.agent_factory is not None else _PickledAgent(agent)
        ranges = self._ranges = split_envs(self.batch_B, self.n_workers)
        self.env_seeds = [
            tuple(env_seed(seed, rank, w, j) for j in range(stop - start)) for w, (start, stop) in enumerate(ranges)
        ]
        try:
            self._shared = SharedBatch.create(spaces, agent.info_spec, self.batch_T, self.batch_B)
            self._weights = SharedWeights.create(self._model_state())
            slot = {w: RNG_SLOT_BYTES + RNG_SLOT_BYTES_PER_ENV * (b - a) for w, (a, b) in enumerate(ranges)}
            self._rng = SharedArrays.create(
                {"lengths": ((self.n_workers, 2), np.int64)}
                | {f"{kind}{w}": ((n,), np.uint8) for w, n in slot.items() for kind in ("save", "load")}
            )
            self._stop = CONTEXT.Event()
            self._go = [CONTEXT.Semaphore(0) for _ in range(self.n_workers)]
            self._done = [CONTEXT.Semaphore(0) for _ in range(self.n_workers)]
            for w, (start, stop) in enumerate(ranges):
                spec = _WorkerSpec(
                    w,
                    self.env_config,
                    spaces,
                    factory,
                    self._shared.handle,
                    self._weights.handle,
                    start,
                    stop,
                    self.env_seeds[w],
                    worker_rng_seed(seed, rank, w),
                    self._rng.handle,
                )
                process = start_process(
                    _worker_main, (spec, self._go[w], self._done[w], self._stop), f"rank {rank} sampler worker {w}"
                )
                self.processes.append(process)
            self._wait_all_done(self.startup_timeout_s, "to start (import, build agent and environments)")
        except BaseException:
            self.shutdown()
            raise

    def obtain_samples(self, itr: int) -> SampleBatch:
        """Collect one batch with the current weights; valid until the next call."""
        if self._shared is None or self._weights is None or self._agent is None:
            raise RlplexError("ParallelSampler.obtain_samples called before initialize() or after shutdown()")
        try:
            self._weights.write(self._model_state())
            for go in self._go:
                go.release()
            self._wait_all_done(self.batch_timeout_s, f"to finish batch {itr}")
        except BaseException:
            # The batch is lost: the other workers are killed, not waited for (see the module).
            self.shutdown(graceful=False)
            raise
        return self._shared.batch

    def state_dict(self) -> dict[str, Any]:
        """Every worker's generator states as of its last batch (workers are idle between batches)."""
        if self._rng is None:
            raise RlplexError("ParallelSampler.state_dict called before initialize() or after shutdown()")
        lengths = self._rng.arrays["lengths"]
        states = [
            json.loads(self._rng.arrays[f"save{w}"][: lengths[w, SAVED]].tobytes()) for w in range(self.n_workers)
        ]
        return {"processes": [s["process"] for s in states], "envs": [e for s in states for e in s["envs"]]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Workers continue the streams of `state` from their next batch.

        A snapshot with another number of sampling processes (a serial sampler's, or other
        `n_workers`) cannot give each worker its own stream: workers then draw from new seeds
        derived from the snapshot's states, so no stream of the run is repeated (environments
        likewise when their number differs, `fit_env_states`)."""
        if self._rng is None:
            raise RlplexError("ParallelSampler.load_state_dict called before initialize() or after shutdown()")
        processes = list(state["processes"])
        envs = fit_env_states(state["envs"], self.batch_B, self._rank)
        reseed = len(processes) != self.n_workers
        entropy = int(streams_digest([*processes, *envs])[:16], 16)
        for w, (start, stop) in enumerate(self._ranges):
            process: Any = worker_rng_seed(entropy, self._rank, w) if reseed else processes[w]
            payload = json.dumps({"process": process, "envs": envs[start:stop]}).encode()
            target = self._rng.arrays[f"load{w}"]
            if len(payload) > len(target):
                raise SnapshotError(f"generator state of sampler worker {w} ({len(payload)} B) exceeds its slot")
            target[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
            self._rng.arrays["lengths"][w, TO_LOAD] = len(payload)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop every worker (politely unless `graceful` is false, then by force) and unlink all
        shared memory. Idempotent."""
        if self._stop is not None and graceful:
            self._stop.set()
            for go in self._go:
                go.release()
            deadline = time.monotonic() + 2.0
            for process in self.processes:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        stop_processes(self.processes)
        self.processes = []
        self._stop = None
        self._go, self._done = [], []
        if self._weights is not None:
            self._weights.close()
            self._weights = None
        if self._shared is not None:
            self._shared.close()
            self._shared = None
        if self._rng is not None:
            self._rng.close()
            self._rng = None

    # ----- internals ----------------------------------------------------------------------
    def _model_state(self) -> dict[str, torch.Tensor]:
        assert self._agent is not None
        return unwrap_model(self._agent.model).state_dict()

    def _wait_all_done(self, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        for w, done in enumerate(self._done):
            while not done.acquire(timeout=POLL_S):
                check_alive(self.processes)
                if time.monotonic() > deadline:
                    raise WaitTimeoutError(
                        f"rank {self._rank} sampler worker {w} (pid {self.processes[w].pid}) took longer than "
                        f"{timeout_s:.0f} s {what}"
                    )


def _wait_for_go(go: Semaphore, stop: Event) -> bool:
    """True when released for a batch; False when told to stop or orphaned."""
    while not go.acquire(timeout=1.0):
        if orphaned():
            return False
    return not stop.is_set()


def _worker_main(spec: _WorkerSpec, go: Semaphore, done: Semaphore, stop: Event) -> None:
    # Each worker owns one core's worth of work; torch's own thread pool would oversubscribe.
    torch.set_num_threads(1)
    torch.manual_seed(spec.rng_seed)
    np.random.seed(spec.rng_seed)
    shared = SharedBatch.attach(spec.batch)
    weights = SharedWeights.attach(spec.weights)
    agent = spec.agent_factory(spec.spaces)
    model = unwrap_model(agent.model)
    envs = [make_env(spec.env) for _ in range(spec.env_stop - spec.env_start)]
    collector = EnvCollector(envs, spec.spaces, spec.seeds)
    view = shared.batch.env_slice(spec.env_start, spec.env_stop)
    rng = SharedArrays.attach(spec.rng)
    loaded_version = 0
    _save_rng(rng, spec.index, collector)
    done.release()  # started
    try:
        while _wait_for_go(go, stop):
            _load_rng(rng, spec.index, collector)
            if weights.version != loaded_version:
                loaded_version = weights.version
                model.load_state_dict(weights.tensors)
            # inference_mode: no autograd bookkeeping at all, a few µs less per policy call.
            with torch.inference_mode():
                collector.collect(agent.step, view, state_reset_of(agent))
            _save_rng(rng, spec.index, collector)
            done.release()
    finally:
        collector.close()
        del view
        rng.close()
        weights.close()
        shared.close()


def _save_rng(rng: SharedArrays, w: int, collector: EnvCollector) -> None:
    payload = json.dumps({"process": process_rng_state(), "envs": collector.rng_states()}).encode()
    target = rng.arrays[f"save{w}"]
    if len(payload) > len(target):
        raise RlplexError(f"sampler worker {w}: generator state of {len(payload)} B exceeds its {len(target)} B slot")
    target[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    rng.arrays["lengths"][w, SAVED] = len(payload)


def _load_rng(rng: SharedArrays, w: int, collector: EnvCollector) -> None:
    lengths = rng.arrays["lengths"]
    if lengths[w, TO_LOAD] == 0:
        return
    state = json.loads(rng.arrays[f"load{w}"][: lengths[w, TO_LOAD]].tobytes())
    lengths[w, TO_LOAD] = 0
    if isinstance(state["process"], int):  # a new seed (see ParallelSampler.load_state_dict)
        torch.manual_seed(state["process"])
        np.random.seed(state["process"])
    else:
        set_process_rng_state(state["process"])
    collector.restore_rng_states(state["envs"])
