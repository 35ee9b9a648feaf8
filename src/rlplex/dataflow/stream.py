"""Asynchronous RL: rollout workers stream finished trajectories into a `StreamDataset`.

    rollout workers --(admission: staleness <= eta)--> StreamDataset (bounded) --> trainer MFCs
          ^                                                                          |
          +----------------- WeightBroadcaster (weights, version) <------------------+

Admission (AReaL's rule): a rollout of n samples may start only while
`started + n <= (version + eta + 1) * batch_size`, where `version` is the trainer's policy
version. Trajectories are trained in order of arrival, so a batch trained at version v holds
only samples started at version >= v - eta. eta = 0 is synchronous RL: one batch is
generated per version and the trainer waits for it; the same code serves both.

Why each side waits is counted: rollout workers on `staleness` (admission) or `capacity`
(the stream is full); the trainer on `data` (the stream is empty).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlplex.errors import RlplexError, WaitTimeoutError


class StreamClosedError(RlplexError):
    """The stream was closed while a caller waited on it."""


@dataclass
class Trajectory:
    data: dict[str, Any]
    version_start: int
    version_end: int
    birth_time: float = field(default_factory=time.monotonic)


class WaitCounters:
    """Seconds and counts of waits, by cause; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.counts: dict[str, int] = collections.defaultdict(int)

    def add(self, cause: str, seconds: float) -> None:
        with self._lock:
            self.seconds[cause] += seconds
            self.counts[cause] += 1

    def metrics(self) -> dict[str, float]:
        with self._lock:
            return {f"waits/{cause}_s": value for cause, value in self.seconds.items()}


class StalenessController:
    """Bounds how far generation may run ahead of training (eta policy versions)."""

    def __init__(self, batch_size: int, eta: int, waits: WaitCounters | None = None) -> None:
        if batch_size < 1 or eta < 0:
            raise RlplexError(f"staleness control needs batch_size >= 1 and eta >= 0 (got {batch_size}, {eta})")
        self.batch_size, self.eta = batch_size, eta
        self.version = 0
        self.started = 0
        self.waits = waits or WaitCounters()
        self._cond = threading.Condition()
        self._closed = False

    def allowance(self) -> int:
        return (self.version + self.eta + 1) * self.batch_size

    def acquire(self, n: int, timeout: float | None = None) -> int:
        """Block until `n` more samples may start; returns the policy version they start at."""
        if n > (self.eta + 1) * self.batch_size:
            raise RlplexError(
                f"a rollout of {n} samples can never be admitted with batch_size {self.batch_size} and eta {self.eta}"
            )
        t0 = time.monotonic()
        with self._cond:
            admitted = self._cond.wait_for(lambda: self._closed or self.started + n <= self.allowance(), timeout)
            if self._closed:
                raise StreamClosedError("staleness controller closed")
            if not admitted:
                raise WaitTimeoutError(
                    f"no admission for {n} samples within {timeout}s (started {self.started}, "
                    f"allowance {self.allowance()} at version {self.version}, eta {self.eta})"
                )
            self.started += n
            version = self.version
        self.waits.add("staleness", time.monotonic() - t0)
        return version

    def set_version(self, version: int) -> None:
        with self._cond:
            self.version = version
            self._cond.notify_all()

    def state_dict(self) -> dict[str, int]:
        """Counters to checkpoint, so staleness stays bounded after a restart (AReaL's hole)."""
        return {"version": self.version, "started": self.started}

    def load_state_dict(self, state: dict[str, int]) -> None:
        with self._cond:
            self.version, self.started = int(state["version"]), int(state["started"])
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class StreamDataset:
    """A bounded, thread-safe FIFO of finished trajectories."""

    def __init__(self, capacity: int, waits: WaitCounters | None = None) -> None:
        self.capacity = capacity
        self.waits = waits or WaitCounters()
        self._items: collections.deque[Trajectory] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, trajectory: Trajectory, timeout: float | None = None) -> None:
        t0 = time.monotonic()
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or len(self._items) < self.capacity, timeout):
                raise WaitTimeoutError(f"stream full ({self.capacity}) for {timeout}s")
            if self._closed:
                raise StreamClosedError("stream closed")
            self._items.append(trajectory)
            self._cond.notify_all()
        self.waits.add("capacity", time.monotonic() - t0)

    def get(self, timeout: float | None = None) -> Trajectory:
        t0 = time.monotonic()
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or bool(self._items), timeout):
                raise WaitTimeoutError(f"no trajectory arrived within {timeout}s")
            if not self._items:
                raise StreamClosedError("stream closed and drained")
            item = self._items.popleft()
            self._cond.notify_all()
        self.waits.add("data", time.monotonic() - t0)
        return item

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class WeightBroadcaster:
    """The trainer publishes (version, weights); generation workers pick up newer ones."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.version = 0
        self._state: dict[str, Any] | None = None

    def publish(self, version: int, state: dict[str, Any]) -> None:
        with self._lock:
            self.version, self._state = version, state

    def latest(self, have: int) -> tuple[int, dict[str, Any] | None]:
        """(version, state) when newer than `have`, else (have, None)."""
        with self._lock:
            if self.version > have and self._state is not None:
                return self.version, self._state
            return have, None


RolloutFn = Callable[[int], list[dict[str, Any]]]
"""Generates and scores one group of samples with the worker's current weights; the
argument is the group's sequence number (to derive prompts and seeds)."""


class RolloutWorker(threading.Thread):
    """Loops: admission -> pick up newer weights -> generate + reward -> stream the samples."""

    def __init__(
        self,
        name: str,
        rollout: RolloutFn,
        load_weights: Callable[[dict[str, Any]], None],
        group_size: int,
        controller: StalenessController,
        stream: StreamDataset,
        weights: WeightBroadcaster,
        next_group: Callable[[], int],
    ) -> None:
        super().__init__(name=name, daemon=True)
        self.rollout, self.load_weights = rollout, load_weights
        self.group_size = group_size
        self.controller, self.stream, self.weights = controller, stream, weights
        self.next_group = next_group
        self.version = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while True:
                self.controller.acquire(self.group_size)
                # Weights published with a version are never older than the admission version.
                self.version, state = self.weights.latest(self.version)
                if state is not None:
                    self.load_weights(state)
                samples = self.rollout(self.next_group())
                version_end = self.weights.version
                for sample in samples:
                    self.stream.put(Trajectory(sample, self.version, version_end))
        except StreamClosedError:
            return
        except BaseException as error:  # surfaced to the trainer, which owns the failure
            self.error = error
            self.stream.close()
