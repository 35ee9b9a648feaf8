"""A uniform replay buffer of transitions as fixed numpy arrays, optionally in shared memory.

Each slot holds one whole transition (observation, action, reward, next_observation,
terminated). Because `next_observation` is stored rather than taken from the following
slot, a time-limit truncation needs no special case: the bootstrap target uses the
observation the episode really ended on, and only `terminated` cuts the bootstrap.

Each slot also keeps `done` (terminated or truncated: the episode ended there) and its
`serial` (its position in the stream of all appended transitions), from which n-step
returns are assembled at sample time (`rlplex.replays.nstep`).

Stacked frames (`EnvSpaces.frame_stack` > 1, Atari): a step shifts the stack by one frame, so
a slot stores two frames, its observation's newest (`frame`) and the next observation's
(`next_frame`), instead of two stacks (8 frames). On sampling, the observation is rebuilt
from the frames of the same environment's previous slots (`stride` apart), back to the start
of its episode, whose stack FrameStackObservation pads with the first frame; the next
observation is that shifted by one frame, ending in `next_frame` (exact at a terminal step
too). This needs every environment's steps appended in order, which every runner does
(AsyncRl's copiers take turns). Every append rebuilds the observations it wrote and refuses a
mismatch, so a stream this layout cannot hold (another padding, steps out of order) is an
error, never a wrong sample. A slot whose earlier frames the ring has overwritten is never
sampled.

The cursor, the size, the total number of transitions ever appended and the number of
environments of the last append (the stride between one environment's consecutive steps)
live in a small counter array that is shared too, so that memory-copier processes (AsyncRl)
and the optimizer agree on them. Appends and samples hold `lock` when one is given (a
multiprocessing lock for the shared case): a sample never sees a half-written slot.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Self

import numpy as np

from rlplex.envs import EnvSpaces
from rlplex.errors import RlplexError, SnapshotError
from rlplex.io.shm_sync import acquire_polling
from rlplex.replays.nstep import nstep_transitions
from rlplex.samplers.shared_arrays import SharedArrays, SharedArraysHandle, allocate

FIELDS = ("observation", "action", "reward", "next_observation", "terminated")
WRITTEN = (*FIELDS, "done")  # what an append copies in
STORED = (*WRITTEN, "serial")  # what a slot holds (with `next_frame` for `next_observation` when stacked)
# Counters every replay kind keeps first (SharedReplay reads them); the uniform one adds a stride.
_CURSOR, _SIZE, _TOTAL, _STRIDE = 0, 1, 2, 3
LOCK_TIMEOUT_S = 30.0


def stacks_frames(spaces: EnvSpaces) -> bool:
    return spaces.frame_stack > 1 and len(spaces.obs_shape) >= 2 and spaces.obs_shape[0] == spaces.frame_stack


def replay_layout(spaces: EnvSpaces, capacity: int) -> dict[str, tuple[tuple[int, ...], Any]]:
    stacked, shape = stacks_frames(spaces), spaces.obs_shape
    obs_name, next_name = ("frame", "next_frame") if stacked else ("observation", "next_observation")
    stored_shape = shape[1:] if stacked else shape
    return {
        obs_name: ((capacity, *stored_shape), spaces.obs_dtype),
        "action": ((capacity, *spaces.action_shape), spaces.action_dtype),
        "reward": ((capacity,), np.float32),
        next_name: ((capacity, *stored_shape), spaces.obs_dtype),
        "terminated": ((capacity,), np.bool_),
        "done": ((capacity,), np.bool_),
        "serial": ((capacity,), np.int64),
        "counters": ((4,), np.int64),
    }


@dataclass(frozen=True)
class ReplayHandle:
    """Picklable: pass it to a child process (as a Process argument, because of the lock)."""

    arrays: SharedArraysHandle
    capacity: int
    lock: Any
    kind: str = "uniform"  # which class `rlplex.replays.attach_replay` attaches
    frame_stack: int = 1  # frames per observation, which a stacked replay rebuilds from its frames


class SharedReplay:
    """What every replay kind shares: its arrays (in one shared block when made with
    shared=True), the write lock, and the handle a child process attaches with."""

    kind = "uniform"
    frame_stack = 1  # frames per observation, where a stacked replay rebuilds them (set by `create`)

    def __init__(self, arrays: dict[str, np.ndarray], capacity: int, lock: Any = None, block: Any = None) -> None:
        self.capacity = capacity
        self._arrays = arrays
        self._counters = arrays["counters"]
        self._lock = lock
        self._block: SharedArrays | None = block
        # Called while waiting for the lock: a process that died holding it never releases it,
        # so the waiter's owner (AsyncRl checks its children here) must get a say.
        self.wait_check: Callable[[], None] | None = None

    @property
    def handle(self) -> ReplayHandle:
        if self._block is None:
            raise RlplexError("this replay buffer is not in shared memory; create it with shared=True")
        return ReplayHandle(self._block.handle, self.capacity, self._lock, self.kind, self.frame_stack)

    @classmethod
    def attach(cls, handle: ReplayHandle) -> Self:
        block = SharedArrays.attach(handle.arrays)
        replay = cls(block.arrays, handle.capacity, handle.lock, block)
        replay.frame_stack = handle.frame_stack
        return replay

    def _locked(self) -> AbstractContextManager[Any]:
        return locked(self._lock, self.wait_check)

    @property
    def size(self) -> int:
        return int(self._counters[_SIZE])

    @property
    def cursor(self) -> int:
        return int(self._counters[_CURSOR])

    @property
    def total_appended(self) -> int:
        return int(self._counters[_TOTAL])


class UniformReplayBuffer(SharedReplay):
    kind = "uniform"

    @property
    def stacked(self) -> bool:
        """Observations are frame stacks: slots keep two frames, not two stacks (see the module)."""
        return "frame" in self._arrays

    @property
    def stored_fields(self) -> tuple[str, ...]:
        return tuple(name for name in (*STORED, "next_frame", "frame") if name in self._arrays)

    def _transitions(self) -> dict[str, Any]:
        """The stored arrays as transitions: observations rebuilt where they are not stored."""
        if not self.stacked:
            return self._arrays
        observation = self._frames()
        return {
            **self._arrays,
            "observation": observation,
            "next_observation": NextFromFrames(observation, self._arrays["next_frame"]),
        }

    def _frames(self) -> ObsFromFrames:
        return ObsFromFrames(self._arrays, int(self._counters[_STRIDE]), self.frame_stack)

    @classmethod
    def create(cls, spaces: EnvSpaces, capacity: int, shared: bool = False, lock: Any = None) -> UniformReplayBuffer:
        if capacity <= 0:
            raise RlplexError(f"replay buffer capacity must be positive (got {capacity})")
        arrays, block = allocate(cls.layout(spaces, capacity), shared)
        buffer = cls(arrays, capacity, lock, block)
        buffer.frame_stack = spaces.obs_shape[0] if stacks_frames(spaces) else 1
        return buffer

    @classmethod
    def layout(cls, spaces: EnvSpaces, capacity: int) -> dict[str, tuple[tuple[int, ...], Any]]:
        return replay_layout(spaces, capacity)

    def close(self) -> None:
        if self._block is not None:
            self._arrays, self._counters = {}, np.zeros(4, dtype=np.int64)
            self._block.close()
            self._block = None
        self._lock = None  # a named semaphore: unlinked once the last reference goes

    # ----- counters -------------------------------------------------------------------------
    # ----- data -----------------------------------------------------------------------------
    def append_samples(self, samples: dict[str, np.ndarray]) -> int:
        """Append transitions with any leading dims ([T, B, ...] or [N, ...]); returns how many.

        Time-major [T, B] batches put one environment's consecutive steps B slots apart, in
        this append and across appends of the same B: n-step returns follow that stride.
        `done` (the episode ended: terminated or truncated) defaults to `terminated`.
        Past `capacity` the oldest transitions are overwritten (a ring buffer). If one call
        brings more than `capacity`, only its last `capacity` transitions are kept.

        An environment whose first step here does not continue its last stored one (a resumed
        run starts new episodes) gets that stored step marked `done`: its episode was cut
        there, so n-step returns and frame stacks stop at it.
        """
        n_dims = samples["reward"].ndim
        stride = int(samples["reward"].shape[1]) if n_dims >= 2 else 1
        columns = {**samples, "done": samples.get("done", samples["terminated"])}
        written = [name for name in self.stored_fields if name != "serial"]
        if self.stacked:  # the newest frame of each observation and of each next one
            columns["frame"] = np.take(samples["observation"], -1, axis=n_dims)
            columns["next_frame"] = np.take(samples["next_observation"], -1, axis=n_dims)
        flat = {name: columns[name].reshape(-1, *columns[name].shape[n_dims:]) for name in written}
        n = len(flat["reward"])
        keep = min(n, self.capacity)
        with self._locked():
            cursor, total = int(self._counters[_CURSOR]), int(self._counters[_TOTAL])
            if n_dims >= 2:
                self._mark_breaks(samples["observation"][0], stride)
            idx = (cursor + np.arange(n - keep, n)) % self.capacity
            for name in written:
                self._arrays[name][idx] = flat[name][n - keep :]
            self._arrays["serial"][idx] = total + np.arange(n - keep, n)
            self._counters[_CURSOR] = (cursor + n) % self.capacity
            self._counters[_SIZE] = min(self.capacity, int(self._counters[_SIZE]) + n)
            self._counters[_TOTAL] += n
            self._counters[_STRIDE] = stride
            if self.stacked:
                observation = samples["observation"].reshape(-1, *samples["observation"].shape[n_dims:])
                self._check_frames(idx, observation[n - keep :])
            self._stored(idx)
        return n

    def _mark_breaks(self, first_observation: np.ndarray, stride: int) -> None:
        """Under the lock, before an append of [T, B = stride] steps: mark `done` the last stored
        step of each environment whose next observation is not its first observation here."""
        cursor, total = int(self._counters[_CURSOR]), int(self._counters[_TOTAL])
        if int(self._counters[_STRIDE]) != stride or int(self._counters[_SIZE]) < stride:
            return
        last = (cursor - stride + np.arange(stride)) % self.capacity
        live = (self._arrays["serial"][last] == total - stride + np.arange(stride)) & ~self._arrays["done"][last]
        if not live.any():
            return
        expected = self._transitions()["next_observation"][last[live]]
        self._arrays["done"][last[live][~continues(expected, first_observation[live])]] = True

    def _check_frames(self, idx: np.ndarray, observation: np.ndarray) -> None:
        """The observations just written, rebuilt from frames, are the ones given (see the module)."""
        frames = self._frames()
        valid = frames.valid(idx)
        if not np.array_equal(frames[idx[valid]], observation[valid]):
            raise RlplexError(
                "replay: a frame-stacked observation does not follow from the frames before it (frames are kept "
                "once per step, so steps must arrive in order and an episode's first stack must repeat its first "
                "frame, as FrameStackObservation's padding_type='reset' does)"
            )

    def _stored(self, idx: np.ndarray) -> None:
        """Called under the lock with the slots an append just wrote (a prioritized replay
        gives them their first priority)."""

    def sample(
        self, batch_size: int, rng: np.random.Generator, n_step: int = 1, gamma: float | None = None
    ) -> dict[str, np.ndarray]:
        """`batch_size` transitions drawn uniformly with replacement (copies).

        With `gamma` the transitions are n-step ones (`rlplex.replays.nstep`): `reward` is
        the discounted sum of up to `n_step` rewards and `discount` the factor of the
        bootstrap from `next_observation`.
        """
        with self._locked():
            size = int(self._counters[_SIZE])
            if size == 0:
                raise RlplexError("cannot sample from an empty replay buffer")
            idx = rng.integers(0, size, size=batch_size)
            if self.stacked:
                frames = self._frames()
                for _ in range(_REDRAWS):  # slots whose earlier frames were overwritten: a few in a full ring
                    lost = ~frames.valid(idx)
                    if not lost.any():
                        break
                    idx[lost] = rng.integers(0, size, size=int(lost.sum()))
                else:
                    raise no_valid_slot(size, frames.stride)
            return self._gather(idx, n_step, gamma)

    def _gather(self, idx: np.ndarray, n_step: int, gamma: float | None) -> dict[str, np.ndarray]:
        arrays = self._transitions()
        if gamma is None:
            return {name: arrays[name][idx] for name in FIELDS}
        return nstep_transitions(arrays, idx, n_step, gamma, int(self._counters[_STRIDE]))

    # ----- snapshots ------------------------------------------------------------------------
    def state_dict(self, include_data: bool = True) -> dict[str, Any]:
        with self._locked():
            state: dict[str, Any] = {"capacity": self.capacity, "counters": self._counters.copy()}
            if include_data:
                size = int(self._counters[_SIZE])
                # Slots [0, size) are exactly the filled ones, whether or not the ring wrapped.
                state["data"] = {name: self._arrays[name][:size].copy() for name in self.stored_fields}
                state.update(self._extra_state(size))
        return state

    def _extra_state(self, size: int) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any], size: int) -> None:
        """Called under the lock after the data of a snapshot is loaded."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["capacity"]) != self.capacity:
            raise SnapshotError(
                f"replay buffer capacity is {state['capacity']} in the snapshot but {self.capacity} now (buffer_size)"
            )
        counters = np.asarray(state["counters"], dtype=np.int64)
        if "data" in state and self.stacked and "frame" not in state["data"] and "observation" in state["data"]:
            # A snapshot of an older rlplex, which kept whole observations: keep their newest frames.
            data = {k: v for k, v in state["data"].items() if k != "observation"}
            state = {**state, "data": {**data, "frame": np.asarray(state["data"]["observation"])[:, -1]}}
        if "data" in state:
            missing = [name for name in self.stored_fields if name not in state["data"]]
            if missing:
                raise SnapshotError(f"the snapshot's replay buffer lacks {missing} (written by an older rlplex)")
        with self._locked():
            if "data" in state:
                size = int(counters[_SIZE])
                for name in self.stored_fields:
                    self._arrays[name][:size] = state["data"][name]
                self._counters[:] = counters
                self._load_extra_state(state, size)
            else:
                # Without the data, keep the step count (schedules depend on it) but start empty.
                self._counters[:] = (0, 0, int(counters[_TOTAL]), 1)
                self._load_extra_state(state, 0)


_REDRAWS = 100


def continues(next_observation: np.ndarray, first_observation: np.ndarray) -> np.ndarray:
    """Per environment ([B, *obs]): whether a batch's first observation is the one the last
    stored step led to; where not, the stream broke there (a resumed run's new episodes)."""
    return (next_observation == first_observation).reshape(len(first_observation), -1).all(axis=1)


def no_valid_slot(size: int, stride: int) -> RlplexError:
    return RlplexError(
        f"replay: no sampled slot has its frames (size {size}, {stride} environments): the replay is too small to "
        "hold a frame stack per environment; raise algo.buffer_size"
    )


class ObsFromFrames:
    """Frame-stacked observations of stacked slots, rebuilt on indexing: slot i's frame
    and those of the same environment's previous slots (`stride` apart), back to the start of
    its episode (where a previous slot's `done` is set, or the run began), whose first frame
    fills the rest of the stack."""

    def __init__(self, arrays: dict[str, np.ndarray], stride: int, stack: int) -> None:
        self.frame, self.done, self.serial = arrays["frame"], arrays["done"], arrays["serial"]
        self.stride, self.stack, self.capacity = max(1, stride), stack, len(self.frame)

    def _back(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(how many previous slots of the same episode each stack reaches back to, capped at
        stack - 1; whether each slot's frames are all still in the ring)."""
        serial = self.serial[idx]
        back = np.zeros(len(idx), dtype=np.int64)
        valid = np.ones(len(idx), dtype=bool)
        walking = np.ones(len(idx), dtype=bool)
        for k in range(1, self.stack):
            expected = serial - k * self.stride
            previous = (idx - k * self.stride) % self.capacity
            began = expected < 0  # no earlier step: the run started here
            kept = self.serial[previous] == expected
            valid &= ~(walking & ~began & ~kept)
            walking &= ~began & kept & ~self.done[previous]
            back[walking] = k
        return back, valid

    def valid(self, idx: np.ndarray) -> np.ndarray:
        return self._back(idx)[1]

    def __getitem__(self, idx: Any) -> np.ndarray:
        idx = np.asarray(idx)
        back, _ = self._back(idx)
        steps = np.arange(self.stack - 1, -1, -1)  # oldest first: stack - 1 steps back, ..., 0
        slots = (idx[:, None] - np.minimum(steps[None, :], back[:, None]) * self.stride) % self.capacity
        return self.frame[slots]


class NextFromFrames:
    """`next_observation` of stacked-frame slots, rebuilt on indexing: the slot's observation
    shifted by one frame, ending in the stored newest frame."""

    def __init__(self, observation: ObsFromFrames, next_frame: np.ndarray) -> None:
        self.observation, self.next_frame = observation, next_frame

    def __getitem__(self, idx: Any) -> np.ndarray:
        return np.concatenate([self.observation[idx][:, 1:], self.next_frame[idx][:, None]], axis=1)


def locked(lock: Any | None, wait_check: Callable[[], None] | None) -> AbstractContextManager[Any]:
    """Hold a shared replay's write lock (a no-op without one). The wait polls so that
    `wait_check` (the runner's "is my peer alive?") runs while another process holds it, and
    gives up after LOCK_TIMEOUT_S rather than hang behind a dead holder."""
    if lock is None:
        return nullcontext()
    acquire_polling(lock, wait_check, "replay buffer write lock", LOCK_TIMEOUT_S)
    return _Release(lock)


class _Release:
    def __init__(self, lock: Any) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
