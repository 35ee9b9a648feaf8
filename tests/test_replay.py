"""The uniform replay buffer: ring maths, sampling, shared memory across processes, snapshots."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from rlplex.envs import EnvSpaces
from rlplex.errors import RlplexError, SnapshotError
from rlplex.io.snapshot import read_snapshot, write_snapshot
from rlplex.processes import CONTEXT
from rlplex.replays import ReplayHandle, UniformReplayBuffer

SPACES = EnvSpaces(obs_shape=(2,), action_kind="discrete", n_actions=3, action_shape=())


def transitions(start: int, n: int) -> dict[str, np.ndarray]:
    """Transition i has observation (i, i), next observation (i+1, i+1), action i % 3, reward i."""
    i = np.arange(start, start + n)
    return {
        "observation": np.stack([i, i], axis=1).astype(np.float32),
        "action": (i % 3).astype(np.int64),
        "reward": i.astype(np.float32),
        "next_observation": np.stack([i + 1, i + 1], axis=1).astype(np.float32),
        "terminated": (i % 4 == 0),
    }


def stored_rewards(buffer: UniformReplayBuffer) -> list[float]:
    return buffer.state_dict()["data"]["reward"].tolist()


def test_ring_buffer_wraps_and_keeps_counters() -> None:
    buffer = UniformReplayBuffer.create(SPACES, capacity=5)
    buffer.append_samples(transitions(0, 3))
    assert (buffer.cursor, buffer.size, buffer.total_appended) == (3, 3, 3)
    assert stored_rewards(buffer) == [0, 1, 2]
    buffer.append_samples(transitions(3, 4))
    assert (buffer.cursor, buffer.size, buffer.total_appended) == (2, 5, 7)
    # items 5 and 6 overwrote the two oldest slots
    assert stored_rewards(buffer) == [5, 6, 2, 3, 4]


def test_one_append_larger_than_capacity_keeps_the_newest_in_ring_order() -> None:
    buffer = UniformReplayBuffer.create(SPACES, capacity=4)
    buffer.append_samples(transitions(0, 1))
    buffer.append_samples(transitions(1, 10))  # items 1..10; only 7..10 survive
    assert (buffer.cursor, buffer.size, buffer.total_appended) == (3, 4, 11)
    assert stored_rewards(buffer) == [8, 9, 10, 7]


def test_time_major_batches_are_flattened_whole() -> None:
    buffer = UniformReplayBuffer.create(SPACES, capacity=16)
    flat = transitions(0, 6)
    batch = {k: v.reshape(3, 2, *v.shape[1:]) for k, v in flat.items()}  # [T=3, B=2, ...]
    assert buffer.append_samples(batch) == 6
    data = buffer.state_dict()["data"]
    np.testing.assert_array_equal(data["observation"], flat["observation"])
    np.testing.assert_array_equal(data["terminated"], flat["terminated"])


def test_sample_draws_whole_transitions_from_filled_slots_only() -> None:
    buffer = UniformReplayBuffer.create(SPACES, capacity=100)
    with pytest.raises(RlplexError, match="empty"):
        buffer.sample(4, np.random.default_rng(0))
    buffer.append_samples(transitions(10, 7))
    batch = buffer.sample(500, np.random.default_rng(0))
    rewards = batch["reward"]
    assert set(rewards.tolist()) == set(range(10, 17))  # every filled slot, none of the zeroed ones
    np.testing.assert_array_equal(batch["observation"][:, 0], rewards)
    np.testing.assert_array_equal(batch["next_observation"][:, 0], rewards + 1)
    np.testing.assert_array_equal(batch["action"], rewards.astype(np.int64) % 3)
    np.testing.assert_array_equal(batch["terminated"], rewards.astype(np.int64) % 4 == 0)


def test_state_dict_round_trips_through_a_snapshot(tmp_path: Path) -> None:
    buffer = UniformReplayBuffer.create(SPACES, capacity=5)
    buffer.append_samples(transitions(0, 7))
    write_snapshot(tmp_path / "snap", {"replay": buffer.state_dict()})
    restored = UniformReplayBuffer.create(SPACES, capacity=5)
    restored.load_state_dict(read_snapshot(tmp_path / "snap")["replay"])
    assert (restored.cursor, restored.size, restored.total_appended) == (2, 5, 7)
    assert stored_rewards(restored) == stored_rewards(buffer)
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    np.testing.assert_array_equal(buffer.sample(8, rng_a)["reward"], restored.sample(8, rng_b)["reward"])


def test_state_without_data_keeps_the_step_count_and_starts_empty() -> None:
    buffer = UniformReplayBuffer.create(SPACES, capacity=5)
    buffer.append_samples(transitions(0, 7))
    restored = UniformReplayBuffer.create(SPACES, capacity=5)
    restored.load_state_dict(buffer.state_dict(include_data=False))
    assert (restored.cursor, restored.size, restored.total_appended) == (0, 0, 7)


def test_capacity_mismatch_is_refused() -> None:
    buffer = UniformReplayBuffer.create(SPACES, capacity=5)
    with pytest.raises(SnapshotError, match="capacity"):
        UniformReplayBuffer.create(SPACES, capacity=6).load_state_dict(buffer.state_dict())


def _append_in_child(handle: ReplayHandle, start: int, n: int) -> None:
    buffer = UniformReplayBuffer.attach(handle)
    buffer.append_samples(transitions(start, n))
    buffer.close()


def test_shared_buffer_is_filled_by_a_child_process_and_unlinked_on_close() -> None:
    buffer = UniformReplayBuffer.create(SPACES, capacity=8, shared=True, lock=CONTEXT.Lock())
    names = [entry[1] for entry in buffer.handle.arrays.arrays]
    try:
        buffer.append_samples(transitions(0, 3))
        child = CONTEXT.Process(target=_append_in_child, args=(buffer.handle, 3, 2))
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0
        assert (buffer.cursor, buffer.size, buffer.total_appended) == (5, 5, 5)
        assert stored_rewards(buffer) == [0, 1, 2, 3, 4]
    finally:
        buffer.close()
    assert not any(os.path.exists(f"/dev/shm/{name}") for name in names)
