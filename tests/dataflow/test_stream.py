"""Asynchronous mode: admission arithmetic at its boundaries, the stream, and the staleness
invariant over a real (tiny) GRPO run."""

from __future__ import annotations

import threading

import pytest

from lm_models import untrained_tiny_model
from rlplex.dataflow.stream import (
    StalenessController,
    StreamClosedError,
    StreamDataset,
    Trajectory,
    fresh_trajectories,
)
from rlplex.errors import RlplexError, WaitTimeoutError
from rlplex.runners.grpo_lm import GRPOLMConfig, train_grpo_lm


@pytest.mark.parametrize(("eta", "allowed"), [(0, 8), (1, 16), (4, 40)])
def test_admission_boundary(eta: int, allowed: int) -> None:
    controller = StalenessController(batch_size=8, eta=eta)
    for _ in range(allowed // 4):
        controller.acquire(4, timeout=0)
    assert controller.started == allowed
    with pytest.raises(WaitTimeoutError, match=f"allowance {allowed} at version 0"):
        controller.acquire(1, timeout=0)
    controller.set_version(1)  # one more batch admitted per policy version
    for _ in range(2):
        controller.acquire(4, timeout=0)
    with pytest.raises(WaitTimeoutError):
        controller.acquire(1, timeout=0)


def test_admission_never_rounds_to_zero_and_rejects_impossible_requests() -> None:
    # AReaL once divided capacity by the data-parallel size twice, rounding it to 0 and hanging.
    controller = StalenessController(batch_size=1, eta=0)
    assert controller.acquire(1, timeout=0) == 0
    with pytest.raises(RlplexError, match="can never be admitted"):
        StalenessController(batch_size=4, eta=1).acquire(9)


def test_controller_counters_round_trip_for_checkpoints() -> None:
    controller = StalenessController(batch_size=4, eta=1)
    controller.acquire(4, timeout=0)
    controller.set_version(3)
    restored = StalenessController(batch_size=4, eta=1)
    restored.load_state_dict(controller.state_dict())
    assert restored.allowance() == controller.allowance() and restored.started == 4


def test_blocked_acquire_released_by_a_new_version_from_another_thread() -> None:
    controller = StalenessController(batch_size=2, eta=0)
    controller.acquire(2, timeout=0)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(controller.acquire(2, timeout=10)))
    waiter.start()
    controller.set_version(1)
    waiter.join(timeout=10)
    assert got == [1]


def test_stream_fifo_capacity_and_close() -> None:
    stream = StreamDataset(capacity=2)
    stream.put(Trajectory({"x": 1}, 0, 0))
    stream.put(Trajectory({"x": 2}, 0, 0))
    with pytest.raises(WaitTimeoutError, match="full"):
        stream.put(Trajectory({"x": 3}, 0, 0), timeout=0.01)
    assert stream.get(timeout=1).data == {"x": 1}
    stream.close()
    assert stream.get(timeout=1).data == {"x": 2}  # drained after close
    with pytest.raises(StreamClosedError):
        stream.get(timeout=1)


@pytest.mark.parametrize("eta", [0, 2])
def test_no_trained_batch_older_than_eta(eta: int) -> None:
    config = GRPOLMConfig(
        model={"name": str(untrained_tiny_model())},
        eta=eta,
        steps=6,
        batch_size=32,
        group_size=4,
        eval_every=6,
        eval_samples=32,
        rollout_workers=2,
    )
    result = train_grpo_lm(config)
    assert result.steps == 6
    assert result.max_staleness <= eta
    if eta == 0:
        assert result.max_staleness == 0


def test_rejected_samples_give_their_admission_back() -> None:
    controller = StalenessController(batch_size=4, eta=0)
    controller.acquire(4, timeout=0)
    with pytest.raises(WaitTimeoutError):
        controller.acquire(4, timeout=0)
    controller.set_version(2)
    assert not controller.accepts(1) and controller.accepts(2)
    controller.reject(4)  # a straggler's group, dropped: its replacement may start
    assert controller.rejected == 4
    controller.acquire(4, timeout=0)
    with pytest.raises(RlplexError, match="give back"):
        controller.reject(5)


def test_stream_state_round_trip_generates_groups_in_flight_again() -> None:
    stream = StreamDataset(capacity=8)
    first, second, third = (stream.issue_group() for _ in range(3))
    stream.put_group(second, [Trajectory({"x": i}, 0, 1) for i in range(2)])
    state = stream.state_dict()
    assert state["pending_groups"] == [first, third] and len(state["items"]) == 2
    restored = StreamDataset(capacity=8)
    restored.load_state_dict(state)
    assert [restored.issue_group() for _ in range(3)] == [first, third, 3]
    assert [restored.get(timeout=0).data for _ in range(2)] == [{"x": 0}, {"x": 1}]
    assert restored.state_dict()["pending_groups"] == [first, third, 3]


def test_fresh_trajectories_drop_what_started_more_than_eta_versions_ago() -> None:
    controller, stream = StalenessController(batch_size=2, eta=1), StreamDataset(capacity=4)
    for _ in range(4):
        controller.acquire(1, timeout=0)
    controller.set_version(3)
    for version_start in (0, 2, 1, 3):  # FIFO by completion: a straggler first
        stream.put(Trajectory({"v": version_start}, version_start, 3))
    fresh = fresh_trajectories(stream, controller, timeout=0)
    assert [next(fresh).version_start for _ in range(2)] == [2, 3]
    assert controller.rejected == 2 and controller.started == 2
