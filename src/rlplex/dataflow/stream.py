"""Asynchronous RL: rollout workers stream finished trajectories into a `StreamDataset`.

    rollout workers --(admission: staleness <= eta)--> StreamDataset (bounded) --> trainer MFCs
          ^                                                                          |
          +----------------- WeightBroadcaster (weights, version) <------------------+

Admission (AReaL's rule): a rollout of n samples may start only while
`started + n <= (version + eta + 1) * batch_size`, where `version` is the trainer's policy
version and `started` counts the admitted samples that were not given back. eta = 0 is
synchronous RL: one batch is generated per version and the trainer waits for it; the same code
serves both.

Admission alone does not bound staleness: the stream is FIFO by completion, so with several
rollout workers a slow one's group (started at version 0) can arrive while the others have
kept the trainer fed for many versions. The trainer therefore takes its samples through
`fresh_trajectories`, which drops every sample started more than eta versions before the
trainer's current version, counts it, and gives its admission back (`reject`) so that a
replacement is generated: the bound holds for any number of workers.

For checkpoints the stream also issues the group numbers the workers generate (`issue_group`)
and knows which are in flight: a group enters the stream whole (`put_group`), so a snapshot
holds either all of a group or none of it, and in-flight groups are generated again on resume.

Why each side waits is counted: rollout workers on `staleness` (admission) or `capacity`
(the stream is full); the trainer on `data` (the stream is empty).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator
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
        self.rejected = 0  # samples admitted, then given back (too stale, or lost in flight)
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

    def accepts(self, version_start: int) -> bool:
        """Whether a sample generated from policy `version_start` may be trained now."""
        with self._cond:
            return self.version - version_start <= self.eta

    def reject(self, n: int) -> None:
        """`n` admitted samples will never be trained: free their admission for replacements.

        Without this a dropped straggler would keep its slots forever and, once the drops
        reached (eta + 1) * batch_size, admission and the trainer would wait on each other.
        """
        with self._cond:
            if n > self.started:
                raise RlplexError(f"cannot give back {n} samples: only {self.started} were admitted")
            self.started -= n
            self.rejected += n
            self._cond.notify_all()

    def state_dict(self) -> dict[str, int]:
        """Counters to checkpoint, so staleness stays bounded after a restart (AReaL's hole)."""
        with self._cond:
            return {"version": self.version, "started": self.started, "rejected": self.rejected}

    def load_state_dict(self, state: dict[str, int]) -> None:
        with self._cond:
            self.version, self.started = int(state["version"]), int(state["started"])
            self.rejected = int(state.get("rejected", 0))
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class StreamDataset:
    """A bounded, thread-safe FIFO of finished trajectories, and the ledger of the groups
    (rollouts) issued to the workers: which are in flight, which come next."""

    def __init__(self, capacity: int, waits: WaitCounters | None = None) -> None:
        self.capacity = capacity
        self.waits = waits or WaitCounters()
        self._items: collections.deque[Trajectory] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._next_group = 0
        self._reissue: collections.deque[int] = collections.deque()  # in flight at a checkpoint
        self._in_flight: set[int] = set()

    def issue_group(self) -> int:
        """The number of the next group to generate (groups lost at a restart come first)."""
        with self._cond:
            if self._reissue:
                group = self._reissue.popleft()
            else:
                group, self._next_group = self._next_group, self._next_group + 1
            self._in_flight.add(group)
            return group

    def put(self, trajectory: Trajectory, timeout: float | None = None) -> None:
        self._put([trajectory], None, timeout)

    def put_group(self, group: int, trajectories: list[Trajectory], timeout: float | None = None) -> None:
        """Append a finished group in one piece and mark it no longer in flight."""
        if len(trajectories) > self.capacity:
            raise RlplexError(f"a group of {len(trajectories)} samples never fits a stream of {self.capacity}")
        self._put(trajectories, group, timeout)

    def _put(self, trajectories: list[Trajectory], group: int | None, timeout: float | None) -> None:
        t0 = time.monotonic()
        n = len(trajectories)
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed or len(self._items) + n <= self.capacity, timeout):
                raise WaitTimeoutError(f"stream full ({self.capacity}) for {timeout}s")
            if self._closed:
                raise StreamClosedError("stream closed")
            self._items.extend(trajectories)
            if group is not None:
                self._in_flight.discard(group)
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

    def state_dict(self) -> dict[str, Any]:
        """The finished trajectories (oldest first) and the group ledger, taken in one piece.

        `pending_groups` were issued but are not in the stream: a restart generates them again
        (with the newer policy, so they are fresher than they would have been).
        """
        with self._cond:
            return {
                "next_group": self._next_group,
                "pending_groups": sorted({*self._in_flight, *self._reissue}),
                "items": [
                    {"data": t.data, "version_start": t.version_start, "version_end": t.version_end}
                    for t in self._items
                ],
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        items = [Trajectory(i["data"], int(i["version_start"]), int(i["version_end"])) for i in state["items"]]
        if len(items) > self.capacity:
            raise RlplexError(f"{len(items)} saved trajectories do not fit a stream of {self.capacity}")
        with self._cond:
            self._items = collections.deque(items)
            self._next_group = int(state["next_group"])
            self._reissue = collections.deque(int(g) for g in state["pending_groups"])
            self._in_flight = set()
            self._cond.notify_all()

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


def fresh_trajectories(
    stream: StreamDataset, controller: StalenessController, timeout: float | None = None
) -> Iterator[Trajectory]:
    """The trainer's view of the stream: trajectories within eta versions of the trainer's
    current version. Older ones are dropped and given back to admission (`reject`); the
    count is `controller.rejected`.

    Pull from it only between train steps (the executor loads a step's batch before it
    trains it), so that the version checked is the version the sample is trained at.
    """
    while True:
        trajectory = stream.get(timeout)
        if controller.accepts(trajectory.version_start):
            yield trajectory
        else:
            controller.reject(1)


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
    ) -> None:
        super().__init__(name=name, daemon=True)
        self.rollout, self.load_weights = rollout, load_weights
        self.group_size = group_size
        self.controller, self.stream, self.weights = controller, stream, weights
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
                group = self.stream.issue_group()
                samples = self.rollout(group)
                version_end = self.weights.version
                self.stream.put_group(group, [Trajectory(sample, self.version, version_end) for sample in samples])
        except StreamClosedError:
            return
        except BaseException as error:  # surfaced to the trainer, which owns the failure
            self.error = error
            self.stream.close()
