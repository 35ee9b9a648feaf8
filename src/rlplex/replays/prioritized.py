"""Prioritized replay (Schaul et al. 2016): a sum-tree over the slots of the uniform replay.

The tree is one flat float64 array of 2P nodes (P the power of two at or above capacity):
node 1 is the root, node k has children 2k and 2k+1, leaf i is node P + i. It lives in the
replay's own array block, so under AsyncRl it is in shared memory with the transitions and
the copier processes give the slots they append the largest priority seen so far, under the
same lock. Sampling and updates are vectorised over the batch: one numpy step per tree level
(20 levels at 1M slots), no Python loop over transitions.

Priorities are given already exponentiated ((|delta| + eps)^alpha, the algorithm's choice):
the tree knows nothing of alpha. Importance weights (N P(i))^-beta are normalised by the
largest in the batch (as rlpyt does), not by the global minimum priority, which would need
a second (min-)tree.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rlplex.envs import EnvSpaces
from rlplex.errors import RlplexError, SnapshotError
from rlplex.replays.uniform import _REDRAWS, _SIZE, UniformReplayBuffer, no_valid_slot, replay_layout


def tree_size(capacity: int) -> int:
    """P: leaves in the tree (a power of two >= capacity)."""
    return 1 << max(0, (capacity - 1).bit_length())


class SumTree:
    """Sums over a flat array `tree` of 2P nodes (a view: it may be shared memory)."""

    def __init__(self, tree: np.ndarray) -> None:
        self.tree = tree
        self.n_leaves = len(tree) // 2
        self.depth = self.n_leaves.bit_length() - 1

    @property
    def total(self) -> float:
        return float(self.tree[1])

    def leaves(self, idx: np.ndarray) -> np.ndarray:
        return self.tree[self.n_leaves + idx]

    def update(self, idx: np.ndarray, values: np.ndarray) -> None:
        """Set leaves `idx` to `values` and recompute their ancestors from their children (not
        by adding deltas, so no rounding error accumulates). A repeated index keeps its last
        value; its ancestors are recomputed twice, to the same sums."""
        node = self.n_leaves + np.asarray(idx, dtype=np.int64)
        self.tree[node] = values
        for _ in range(self.depth):
            node >>= 1
            self.tree[node] = self.tree[2 * node] + self.tree[2 * node + 1]

    def rebuild(self) -> None:
        """Recompute every inner node from the leaves, one level at a time."""
        level = self.n_leaves
        while level > 1:
            parents = np.arange(level // 2, level)
            self.tree[parents] = self.tree[2 * parents] + self.tree[2 * parents + 1]
            level //= 2

    def find(self, mass: np.ndarray) -> np.ndarray:
        """The leaf whose prefix-sum interval holds each of `mass` (values in [0, total))."""
        node = np.ones(len(mass), dtype=np.int64)
        mass = mass.astype(np.float64, copy=True)
        for _ in range(self.depth):
            left = 2 * node
            left_sum = self.tree[left]
            right = mass >= left_sum
            mass -= left_sum * right
            node = left + right
        return node - self.n_leaves

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """`n` leaves drawn with probability proportional to their values, stratified: one
        draw in each of n equal slices of the total mass (lower variance than n free draws)."""
        mass = (np.arange(n) + rng.random(n)) * (self.total / n)
        return self.find(mass)


class PrioritizedReplayBuffer(UniformReplayBuffer):
    """The uniform replay plus a sum-tree of priorities over its slots."""

    kind = "prioritized"

    def __init__(self, arrays: dict[str, np.ndarray], capacity: int, lock: Any = None, block: Any = None) -> None:
        super().__init__(arrays, capacity, lock, block)
        self.tree = SumTree(arrays["tree"])
        self._max_priority = arrays["max_priority"]  # the largest priority given so far, shared

    @classmethod
    def layout(cls, spaces: EnvSpaces, capacity: int) -> dict[str, tuple[tuple[int, ...], Any]]:
        return {
            **replay_layout(spaces, capacity),
            "tree": ((2 * tree_size(capacity),), np.float64),
            "max_priority": ((1,), np.float64),
        }

    def _stored(self, idx: np.ndarray) -> None:
        if self._max_priority[0] <= 0:
            self._max_priority[0] = 1.0
        self.tree.update(idx, np.full(len(idx), self._max_priority[0]))

    def sample(
        self, batch_size: int, rng: np.random.Generator, n_step: int = 1, gamma: float | None = None, beta: float = 1.0
    ) -> dict[str, np.ndarray]:
        """Transitions drawn in proportion to their priorities, as `UniformReplayBuffer.sample`
        gives them, plus `index` and `serial` (for `update_priorities`) and `weight`, the
        importance weight (N P(i))^-beta over the batch's largest."""
        with self._locked():
            size = int(self._counters[_SIZE])
            if size == 0:
                raise RlplexError("cannot sample from an empty replay buffer")
            # Float rounding can land a draw past the last filled leaf: keep it on the last one.
            idx = np.minimum(self.tree.sample(batch_size, rng), size - 1)
            if self.stacked:
                frames = self._frames()
                for _ in range(_REDRAWS):
                    # A slot whose earlier frames the ring overwrote stays unusable until it is
                    # itself overwritten (which gives it a priority again): it leaves the tree.
                    lost = ~frames.valid(idx)
                    if not lost.any():
                        break
                    gone = np.unique(idx[lost])
                    self.tree.update(gone, np.zeros(len(gone)))
                    if self.tree.total <= 0:
                        raise no_valid_slot(size, frames.stride)
                    idx = np.minimum(self.tree.sample(batch_size, rng), size - 1)
                else:
                    raise no_valid_slot(size, frames.stride)
            probability = self.tree.leaves(idx) / self.tree.total
            batch = self._gather(idx, n_step, gamma)
            batch["serial"] = self._arrays["serial"][idx]
        weight = (size * probability) ** -beta
        batch["index"] = idx
        batch["weight"] = (weight / weight.max()).astype(np.float32)
        return batch

    def update_priorities(self, idx: np.ndarray, priorities: np.ndarray, serial: np.ndarray | None = None) -> None:
        """Give slots `idx` new (positive, already exponentiated) priorities. With `serial` (from
        `sample`), slots overwritten since they were sampled (AsyncRl's copiers append
        meanwhile) keep the top priority their new transition got."""
        priorities = np.asarray(priorities, dtype=np.float64)
        if not np.all(np.isfinite(priorities) & (priorities > 0)):
            bad = priorities[~(np.isfinite(priorities) & (priorities > 0))][:3].tolist()
            raise RlplexError(
                f"prioritized replay: priorities must be positive and finite, got {bad} (did the loss diverge?)"
            )
        with self._locked():
            if serial is not None:
                same = self._arrays["serial"][idx] == serial
                idx, priorities = idx[same], priorities[same]
            self.tree.update(idx, priorities)
            if len(priorities):
                self._max_priority[0] = max(float(self._max_priority[0]), float(priorities.max()))

    def _extra_state(self, size: int) -> dict[str, Any]:
        return {"priorities": self.tree.leaves(np.arange(size)).copy(), "max_priority": float(self._max_priority[0])}

    def _load_extra_state(self, state: dict[str, Any], size: int) -> None:
        self.tree.tree[:] = 0.0
        self._max_priority[0] = 0.0
        if size == 0:
            return
        if "priorities" not in state:
            raise SnapshotError("the snapshot's replay buffer has no priorities (it was not a prioritized replay)")
        self.tree.tree[self.tree.n_leaves : self.tree.n_leaves + size] = state["priorities"]
        self.tree.rebuild()
        self._max_priority[0] = float(state["max_priority"])
