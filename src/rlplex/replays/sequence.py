"""A replay of fixed-length sequences for recurrent agents (R2D1), optionally prioritized.

Each slot holds one sequence of `length` consecutive steps of one environment (observation,
action, reward, terminated, done) and the recurrent state the sampler's agent had before its
first step (`rnn_h`, `rnn_c`). `sequences_of` cuts them from a [T, B] sampler batch, starting
every `period` steps, so that consecutive sequences overlap by `length - period` steps (the
burn-in and the n-step tail). `SequenceCarry` keeps the steps that the next sequences start
in, so sequences run on across batch boundaries at every `period` steps of each environment's
stream and every step after the first burn-in is trained. Batches must arrive in order: under
MinibatchRl and SyncRl they do; under AsyncRl the carry is in shared memory and its two copier
processes cut their batches through it in turn. `sequences_of` cuts the sequences whole in one
batch, without a carry. Episodes may end inside a sequence (`done`): training resets the state there.

A prioritized replay keeps one priority per sequence in `SumTree` (the one of
`rlplex.replays.prioritized`), in the same array block; R2D2's mix of the sequence's TD
errors, eta * max + (1 - eta) * mean, is the algorithm's to compute. Appends and samples hold
`lock` when one is given (shared memory under AsyncRl), as in `UniformReplayBuffer`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlplex.envs import EnvSpaces
from rlplex.errors import RlplexError, SnapshotError
from rlplex.replays.prioritized import SumTree, tree_size
from rlplex.replays.uniform import SharedReplay, continues, locked
from rlplex.samplers.shared_arrays import Layout, SharedArrays, SharedArraysHandle, allocate

SEQUENCE_FIELDS = ("observation", "action", "reward", "terminated", "done")
STATE_FIELDS = ("rnn_h", "rnn_c")
STORED = (*SEQUENCE_FIELDS, *STATE_FIELDS, "serial")
_FIELDS = (*SEQUENCE_FIELDS, *STATE_FIELDS)
_CURSOR, _SIZE, _TOTAL = 0, 1, 2


def _columns(samples: Any) -> dict[str, np.ndarray]:  # samples: a SampleBatch with agent_info rnn_h, rnn_c
    """What a sequence holds of a [T, B] batch, time-major ([T, B, ...]; the states [T, B, H])."""
    return {
        "observation": samples.observation,
        "action": samples.action,
        "reward": samples.reward,
        "terminated": samples.terminated,
        "done": samples.terminated | samples.truncated,
        **{name: samples.agent_info[name] for name in STATE_FIELDS},
    }


def _cut(columns: dict[str, np.ndarray], length: int, period: int) -> tuple[dict[str, np.ndarray], int]:
    """Every environment's steps [s, s + length) for s = 0, period, ... while they fit:
    [N, length, ...] fields and [N, H] start states; and the first start that did not fit."""
    T = len(columns["reward"])
    starts = np.arange(0, T - length + 1, period)
    window = starts[:, None] + np.arange(length)  # [S, L]
    out: dict[str, np.ndarray] = {}
    for name in SEQUENCE_FIELDS:  # [T, B, ...] -> [S, L, B, ...] -> [S, B, L, ...] -> [S * B, L, ...]
        array = columns[name]
        out[name] = np.swapaxes(array[window], 1, 2).reshape(-1, length, *array.shape[2:])
    for name in STATE_FIELDS:
        state = columns[name][starts]  # [S, B, H]
        out[name] = state.reshape(-1, state.shape[-1])
    return out, len(starts) * period


def sequences_of(samples: Any, length: int, period: int) -> dict[str, np.ndarray]:
    """The sequences whole in one [T, B] batch (AsyncRl's copiers: see the module)."""
    if length > samples.T:
        raise RlplexError(f"a sequence of {length} steps does not fit in a batch of batch_T = {samples.T} steps")
    return _cut(_columns(samples), length, period)[0]


@dataclass(frozen=True)
class CarryHandle:
    """What a process needs to attach to a shared `SequenceCarry` (picklable)."""

    arrays: SharedArraysHandle
    length: int
    period: int
    lock: Any


class SequenceCarry:
    """Cuts the sequences of batches that arrive in order, running on across their boundaries:
    the steps from the first start that did not fit are kept and put before the next batch.
    At most `length - 1` steps per environment are kept; `state_dict` holds them, so a resumed
    run cuts the same sequences as one that was never stopped. An environment whose next batch
    does not continue its kept steps (a resumed run starts new episodes) has its last kept step
    marked `done`: training resets the recurrent state there and cuts returns.

    The kept steps live in fixed arrays ([length - 1, B, ...] and their count): plain ones made at
    the first batch, or in shared memory (`create_shared`), where AsyncRl's copier processes cut
    their batches in turn through the same carry (`attach`) and the learner snapshots it."""

    def __init__(
        self,
        length: int,
        period: int,
        arrays: dict[str, np.ndarray] | None = None,
        lock: Any = None,
        block: SharedArrays | None = None,
    ) -> None:
        self.length, self.period = length, period
        self._arrays, self._lock, self._block = arrays, lock, block

    @staticmethod
    def layout(length: int, spaces: EnvSpaces, batch_B: int, state_size: int) -> Layout:
        kept = (max(1, length - 1), batch_B)
        obs = np.uint8 if spaces.obs_dtype == "uint8" else np.float32
        return {
            "observation": ((*kept, *spaces.obs_shape), obs),
            "action": ((*kept, *spaces.action_shape), spaces.action_dtype),
            "reward": (kept, np.float32),
            "terminated": (kept, np.bool_),
            "done": (kept, np.bool_),
            "rnn_h": ((*kept, state_size), np.float32),
            "rnn_c": ((*kept, state_size), np.float32),
            "next_observation": ((batch_B, *spaces.obs_shape), obs),
            "n_kept": ((1,), np.int64),
        }

    @classmethod
    def create_shared(cls, length: int, period: int, spaces: EnvSpaces, batch_B: int, state_size: int) -> SequenceCarry:
        from rlplex.processes import CONTEXT

        arrays, block = allocate(cls.layout(length, spaces, batch_B, state_size), shared=True)
        return cls(length, period, arrays, CONTEXT.Lock(), block)

    @property
    def handle(self) -> CarryHandle:
        if self._block is None:
            raise RlplexError("this sequence carry is not in shared memory; make it with create_shared")
        return CarryHandle(self._block.handle, self.length, self.period, self._lock)

    @classmethod
    def attach(cls, handle: CarryHandle) -> SequenceCarry:
        block = SharedArrays.attach(handle.arrays)
        return cls(handle.length, handle.period, block.arrays, handle.lock, block)

    def close(self) -> None:
        if self._block is not None:
            self._block.close()
            self._block, self._arrays = None, None

    # ----- the kept steps, whatever holds them ---------------------------------------------------
    def _kept(self) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
        """Copies of the kept steps [n, B, ...] and each environment's next observation."""
        arrays = self._arrays
        n = 0 if arrays is None else int(arrays["n_kept"][0])
        if arrays is None or not n:
            return None
        return {name: arrays[name][:n].copy() for name in _FIELDS}, arrays["next_observation"].copy()

    def _forget(self) -> None:
        if self._arrays is not None:
            self._arrays["n_kept"][0] = 0

    def _keep(self, kept: dict[str, np.ndarray], next_observation: np.ndarray) -> None:
        n, arrays = len(kept["reward"]), self._arrays
        if not n:
            self._forget()
            return
        if arrays is None or not _holds(arrays, kept):
            if arrays is not None and self._block is not None:
                # Shared arrays keep their shape: a snapshot's steps of another number of
                # environments are dropped, and the next sequences start afresh.
                self._forget()
                return
            # Plain arrays, shaped by the first batch (again when the number of environments changes).
            rows = max(1, self.length - 1, n)
            arrays = {name: np.zeros((rows, *kept[name].shape[1:]), kept[name].dtype) for name in _FIELDS}
            arrays["next_observation"] = np.zeros_like(next_observation)
            arrays["n_kept"] = np.zeros(1, np.int64)
            self._arrays = arrays
        for name in _FIELDS:
            arrays[name][:n] = kept[name]
        arrays["next_observation"][:] = next_observation
        arrays["n_kept"][0] = n

    def cut(self, samples: Any, wait_check: Callable[[], None] | None = None) -> dict[str, np.ndarray]:
        columns = _columns(samples)
        with locked(self._lock, wait_check):
            previous = self._kept()
            if previous is not None and previous[0]["reward"].shape[1:] == columns["reward"].shape[1:]:
                # (Kept steps of another number of environments, from a snapshot, are dropped: the
                # next sequences then start afresh, as at the start of a run.)
                kept, next_observation = previous
                kept["done"][-1] |= ~continues(next_observation, samples.observation[0])
                columns = {name: np.concatenate([kept[name], array]) for name, array in columns.items()}
            out, next_start = _cut(columns, self.length, self.period)
            self._keep({name: array[next_start:] for name, array in columns.items()}, samples.next_observation[-1])
        return out

    def state_dict(self, wait_check: Callable[[], None] | None = None) -> dict[str, np.ndarray]:
        with locked(self._lock, wait_check):
            previous = self._kept()
        if previous is None:
            return {}
        return {**previous[0], "next_observation": previous[1]}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        if not state:
            with locked(self._lock, None):
                self._forget()
            return
        missing = sorted({*_FIELDS, "next_observation"} - set(state))
        if missing:
            raise SnapshotError(f"the R2D1 sequence carry lacks {missing}")
        with locked(self._lock, None):
            self._keep({name: np.array(state[name]) for name in _FIELDS}, np.array(state["next_observation"]))


def _holds(arrays: dict[str, np.ndarray], kept: dict[str, np.ndarray]) -> bool:
    """Whether `arrays` have room for `kept`'s steps, of the same number of environments."""
    rows = len(arrays["reward"]) >= len(kept["reward"])
    return rows and all(arrays[name].shape[1:] == kept[name].shape[1:] for name in _FIELDS)


class SequenceReplayBuffer(SharedReplay):
    kind = "sequence"

    def __init__(
        self, arrays: dict[str, np.ndarray], capacity: int, lock: Any = None, block: SharedArrays | None = None
    ) -> None:
        super().__init__(arrays, capacity, lock, block)
        self.prioritized = "tree" in arrays
        self.tree = SumTree(arrays["tree"]) if self.prioritized else None

    @staticmethod
    def layout(
        spaces: EnvSpaces, capacity: int, length: int, state_size: int, prioritized: bool
    ) -> dict[str, tuple[tuple[int, ...], Any]]:
        layout: dict[str, tuple[tuple[int, ...], Any]] = {
            "observation": ((capacity, length, *spaces.obs_shape), np.float32),
            "action": ((capacity, length, *spaces.action_shape), spaces.action_dtype),
            "reward": ((capacity, length), np.float32),
            "terminated": ((capacity, length), np.bool_),
            "done": ((capacity, length), np.bool_),
            "rnn_h": ((capacity, state_size), np.float32),
            "rnn_c": ((capacity, state_size), np.float32),
            "serial": ((capacity,), np.int64),
            "counters": ((3,), np.int64),
        }
        if prioritized:
            layout["tree"] = ((2 * tree_size(capacity),), np.float64)
            layout["max_priority"] = ((1,), np.float64)
        return layout

    @classmethod
    def create(
        cls,
        spaces: EnvSpaces,
        capacity: int,
        length: int,
        state_size: int,
        prioritized: bool = False,
        shared: bool = False,
        lock: Any = None,
    ) -> SequenceReplayBuffer:
        if capacity <= 0:
            raise RlplexError(f"replay buffer capacity must be positive (got {capacity})")
        arrays, block = allocate(cls.layout(spaces, capacity, length, state_size, prioritized), shared)
        return cls(arrays, capacity, lock, block)

    def close(self) -> None:
        if self._block is not None:
            self._arrays, self._counters = {}, np.zeros(3, dtype=np.int64)
            self.tree = None
            self._block.close()
            self._block = None
        self._lock = None

    def append_samples(self, sequences: dict[str, np.ndarray]) -> int:
        """Append [N, ...] sequences (from `sequences_of`); past `capacity` the oldest go."""
        n = len(sequences["reward"])
        keep = min(n, self.capacity)
        with self._locked():
            cursor, total = int(self._counters[_CURSOR]), int(self._counters[_TOTAL])
            idx = (cursor + np.arange(n - keep, n)) % self.capacity
            for name in (*SEQUENCE_FIELDS, *STATE_FIELDS):
                self._arrays[name][idx] = sequences[name][n - keep :]
            self._arrays["serial"][idx] = total + np.arange(n - keep, n)
            self._counters[_CURSOR] = (cursor + n) % self.capacity
            self._counters[_SIZE] = min(self.capacity, int(self._counters[_SIZE]) + n)
            self._counters[_TOTAL] += n
            if self.tree is not None:  # new sequences get the largest priority seen so far
                top = self._arrays["max_priority"]
                if top[0] <= 0:
                    top[0] = 1.0
                self.tree.update(idx, np.full(len(idx), top[0]))
        return n

    def sample(self, batch_size: int, rng: np.random.Generator, beta: float = 1.0) -> dict[str, np.ndarray]:
        """`batch_size` sequences (copies) with `index` and `serial` (for `update_priorities`);
        uniform, or in proportion to priority with the importance `weight` (N P(i))^-beta over
        the batch's largest."""
        with self._locked():
            size = int(self._counters[_SIZE])
            if size == 0:
                raise RlplexError("cannot sample from an empty replay buffer")
            if self.tree is None:
                idx = rng.integers(0, size, size=batch_size)
            else:
                idx = np.minimum(self.tree.sample(batch_size, rng), size - 1)
                probability = self.tree.leaves(idx) / self.tree.total
            batch = {name: self._arrays[name][idx] for name in (*SEQUENCE_FIELDS, *STATE_FIELDS, "serial")}
        batch["index"] = idx
        if self.tree is not None:
            weight = (size * probability) ** -beta
            batch["weight"] = (weight / weight.max()).astype(np.float32)
        return batch

    def update_priorities(self, idx: np.ndarray, priorities: np.ndarray, serial: np.ndarray) -> None:
        """New (positive, exponentiated) priorities of sequences `idx`, except those
        overwritten since they were sampled (their `serial` moved)."""
        if self.tree is None:
            raise RlplexError("update_priorities on a replay that is not prioritized")
        priorities = np.asarray(priorities, dtype=np.float64)
        if not np.all(np.isfinite(priorities) & (priorities > 0)):
            raise RlplexError("prioritized replay: priorities must be positive and finite (did the loss diverge?)")
        with self._locked():
            same = self._arrays["serial"][idx] == serial
            self.tree.update(idx[same], priorities[same])
            if same.any():
                top = self._arrays["max_priority"]
                top[0] = max(float(top[0]), float(priorities[same].max()))

    # ----- snapshots ------------------------------------------------------------------------
    def state_dict(self, include_data: bool = True) -> dict[str, Any]:
        with self._locked():
            state: dict[str, Any] = {"capacity": self.capacity, "counters": self._counters.copy()}
            if include_data:
                size = int(self._counters[_SIZE])
                state["data"] = {name: self._arrays[name][:size].copy() for name in STORED}
                if self.tree is not None:
                    state["priorities"] = self.tree.leaves(np.arange(size)).copy()
                    state["max_priority"] = float(self._arrays["max_priority"][0])
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["capacity"]) != self.capacity:
            raise SnapshotError(
                f"replay buffer capacity is {state['capacity']} in the snapshot but {self.capacity} now (buffer_size)"
            )
        counters = np.asarray(state["counters"], dtype=np.int64)
        with self._locked():
            if self.tree is not None:
                self.tree.tree[:] = 0.0
                self._arrays["max_priority"][0] = 0.0
            if "data" not in state:  # keep the count, start empty
                self._counters[:] = (0, 0, int(counters[_TOTAL]))
                return
            size = int(counters[_SIZE])
            for name in STORED:
                self._arrays[name][:size] = state["data"][name]
            self._counters[:] = counters
            if self.tree is not None and size:
                if "priorities" not in state:
                    raise SnapshotError("the snapshot's sequence replay has no priorities (it was not prioritized)")
                self.tree.tree[self.tree.n_leaves : self.tree.n_leaves + size] = state["priorities"]
                self.tree.rebuild()
                self._arrays["max_priority"][0] = float(state["max_priority"])
