"""DataPlane: ownership, loss after a store restarts, and release cost."""

from __future__ import annotations

import time

import pytest

from rlplex.dataflow import DataPlane, LocalTensorStore
from rlplex.dataflow.dataplane import DataPlaneError

KEYS = ["prompt", "seq", "logp", "reward"]


def filled(n: int) -> DataPlane:
    stores = [LocalTensorStore(f"s{i}") for i in range(2)]
    plane = DataPlane(stores)
    for start in range(0, n, 256):
        ids = list(range(start, min(start + 256, n)))
        for key in KEYS:
            stores[start // 256 % 2].put_many(ids, key, [0] * len(ids))
        plane.record(f"s{start // 256 % 2}", ids, KEYS)
    return plane


def best_release_s(plane: DataPlane, first: int, batches: int = 20) -> float:
    best = float("inf")
    for b in range(batches):
        ids = list(range(first + 256 * b, first + 256 * (b + 1)))
        t0 = time.perf_counter()
        plane.release(ids)
        best = min(best, time.perf_counter() - t0)
    return best


def test_release_costs_the_released_ids_not_everything_in_flight() -> None:
    # 256 ids released with 100k datapoints in flight vs with 6k: a scan of the whole map
    # (the old release) made this ratio ~16; an index by id keeps it near 1.
    small, large = filled(256 * 24), filled(256 * 400)
    ratio = best_release_s(large, 0) / best_release_s(small, 0)
    assert ratio < 4, f"release slows with occupancy: {ratio:.1f}x"
    assert large.n_values == (400 - 20) * 256 * len(KEYS)
    with pytest.raises(DataPlaneError, match="no store holds key 'seq' of datapoint 0"):
        large.locate([0], "seq")


class Restartable(LocalTensorStore):
    incarnation = 0


def test_values_of_a_restarted_store_are_reported_lost() -> None:
    dead, alive = Restartable("dead"), LocalTensorStore("alive")
    plane = DataPlane([dead, alive])
    plane.record("dead", [0, 1], ["seq"])
    plane.record("alive", [0, 1], ["reward"])
    assert plane.lost([0, 1], ["seq", "reward"]) == {}
    dead.incarnation = 1
    assert plane.lost([0, 1, 7], ["seq", "reward"]) == {"seq": [0, 1]}
    plane.record("dead", [1], ["seq"])  # recomputed into the new incarnation
    assert plane.lost([0, 1], ["seq"]) == {"seq": [0]}
