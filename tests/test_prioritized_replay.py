"""The sum-tree and the prioritized replay: proportional sampling, updates, the ring's wrap,
importance weights, snapshots; n-step transitions. Priorities in shared memory, written by
AsyncRl's copier processes: tests/test_dqn_rainbow.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rlplex.envs import EnvSpaces
from rlplex.errors import RlplexError, SnapshotError
from rlplex.io.snapshot import read_snapshot, write_snapshot
from rlplex.replays import PrioritizedReplayBuffer, SumTree, UniformReplayBuffer
from rlplex.replays.nstep import nstep_transitions
from rlplex.replays.prioritized import tree_size

SPACES = EnvSpaces(obs_shape=(1,), action_kind="discrete", n_actions=2, action_shape=())


def transitions(start: int, n: int) -> dict[str, np.ndarray]:
    """Transition i: observation i, next observation i + 1, reward i, never terminated."""
    i = np.arange(start, start + n)
    return {
        "observation": i[:, None].astype(np.float32),
        "action": (i % 2).astype(np.int64),
        "reward": i.astype(np.float32),
        "next_observation": (i + 1)[:, None].astype(np.float32),
        "terminated": np.zeros(n, dtype=bool),
    }


def assert_sums_consistent(tree: SumTree) -> None:
    inner = np.arange(1, tree.n_leaves)
    np.testing.assert_allclose(tree.tree[inner], tree.tree[2 * inner] + tree.tree[2 * inner + 1])


# ----- the sum-tree ----------------------------------------------------------------------------
def test_tree_size_is_the_power_of_two_at_or_above_capacity() -> None:
    assert [tree_size(c) for c in (1, 2, 5, 8, 9, 1_000_000)] == [1, 2, 8, 8, 16, 1 << 20]


def test_sampling_proportions_match_the_priorities() -> None:
    tree = SumTree(np.zeros(2 * tree_size(5)))
    priorities = np.array([1.0, 2.0, 3.0, 4.0, 10.0])
    tree.update(np.arange(5), priorities)
    assert tree.total == pytest.approx(20.0)
    draws = np.concatenate([tree.sample(256, np.random.default_rng(seed)) for seed in range(200)])
    assert draws.min() >= 0 and draws.max() <= 4  # never an empty leaf
    frequency = np.bincount(draws, minlength=5) / len(draws)
    # 51 200 draws: the standard error of a share is below 0.0025; stratification lowers it further.
    np.testing.assert_allclose(frequency, priorities / priorities.sum(), atol=0.01)


def test_find_maps_prefix_mass_to_leaves_exactly() -> None:
    tree = SumTree(np.zeros(2 * tree_size(4)))
    tree.update(np.arange(4), np.array([1.0, 0.5, 2.0, 0.5]))
    # intervals: [0, 1) -> 0, [1, 1.5) -> 1, [1.5, 3.5) -> 2, [3.5, 4) -> 3
    found = tree.find(np.array([0.0, 0.99, 1.0, 1.49, 1.5, 3.49, 3.5, 3.99]))
    np.testing.assert_array_equal(found, [0, 0, 1, 1, 2, 2, 3, 3])


def test_updates_keep_every_inner_node_the_sum_of_its_children() -> None:
    rng = np.random.default_rng(0)
    tree = SumTree(np.zeros(2 * tree_size(1000)))
    tree.update(np.arange(1000), rng.random(1000))
    for _ in range(20):
        idx = rng.integers(0, 1000, size=64)  # repeats included
        tree.update(idx, rng.random(64) + 0.1)
    assert_sums_consistent(tree)
    tree.update(np.array([7, 7]), np.array([5.0, 9.0]))  # a repeated index keeps its last value
    assert tree.leaves(np.array([7]))[0] == 9.0
    assert_sums_consistent(tree)
    leaves = tree.leaves(np.arange(1000)).copy()
    tree.tree[1 : tree.n_leaves] = 0.0
    tree.rebuild()
    assert tree.total == pytest.approx(leaves.sum())
    assert_sums_consistent(tree)


# ----- the prioritized replay -------------------------------------------------------------------
def test_new_transitions_get_the_top_priority_also_after_the_ring_wraps() -> None:
    buffer = PrioritizedReplayBuffer.create(SPACES, capacity=5)
    buffer.append_samples(transitions(0, 3))
    np.testing.assert_array_equal(buffer.tree.leaves(np.arange(5)), [1, 1, 1, 0, 0])
    buffer.update_priorities(np.array([0, 1, 2]), np.array([0.5, 7.0, 2.0]))
    buffer.append_samples(transitions(3, 4))  # fills slots 3, 4 and overwrites 0, 1
    np.testing.assert_array_equal(buffer.tree.leaves(np.arange(5)), [7, 7, 2, 7, 7])
    assert (buffer.cursor, buffer.size) == (2, 5)
    assert_sums_consistent(buffer.tree)
    with pytest.raises(RlplexError, match=r"positive and finite, got \[0.0, nan\]"):
        buffer.update_priorities(np.array([0, 1]), np.array([0.0, np.nan]))
    # a slot overwritten since it was sampled keeps its new transition's top priority
    sampled = buffer.sample(64, np.random.default_rng(0))
    slot = int(sampled["index"][0])
    buffer.append_samples(transitions(7, 5))  # the ring comes round: every slot rewritten
    buffer.update_priorities(sampled["index"][:1], np.array([0.125]), sampled["serial"][:1])
    assert buffer.tree.leaves(np.array([slot]))[0] == 7.0


def test_samples_follow_priorities_with_annealed_importance_weights() -> None:
    buffer = PrioritizedReplayBuffer.create(SPACES, capacity=4)
    buffer.append_samples(transitions(0, 4))
    buffer.update_priorities(np.arange(4), np.array([1.0, 1.0, 2.0, 4.0]))
    batch = buffer.sample(4096, np.random.default_rng(0), beta=0.5)
    np.testing.assert_array_equal(batch["reward"], batch["index"].astype(np.float32))  # whole transitions
    share = np.bincount(batch["index"], minlength=4) / 4096
    np.testing.assert_allclose(share, [0.125, 0.125, 0.25, 0.5], atol=0.02)
    # w_i = (N P(i))^-beta / max_j w_j: the least likely slots weigh 1, the likeliest (1/4)^0.5 of it.
    expected = {0: 1.0, 1: 1.0, 2: 0.5**0.5, 3: 0.25**0.5}
    for i, weight in expected.items():
        np.testing.assert_allclose(batch["weight"][batch["index"] == i], weight, rtol=1e-6)
    assert np.all(buffer.sample(16, np.random.default_rng(1), beta=0.0)["weight"] == 1.0)


def test_prioritized_state_round_trips_through_a_snapshot(tmp_path: Path) -> None:
    buffer = PrioritizedReplayBuffer.create(SPACES, capacity=6)
    buffer.append_samples(transitions(0, 8))
    buffer.update_priorities(np.array([1, 4]), np.array([3.0, 0.25]))
    write_snapshot(tmp_path / "s", {"replay": buffer.state_dict()})
    restored = PrioritizedReplayBuffer.create(SPACES, capacity=6)
    restored.load_state_dict(read_snapshot(tmp_path / "s")["replay"])
    np.testing.assert_array_equal(restored.tree.tree, buffer.tree.tree)
    a, b = buffer.sample(32, np.random.default_rng(5)), restored.sample(32, np.random.default_rng(5))
    for key in ("index", "weight", "reward"):
        np.testing.assert_array_equal(a[key], b[key])
    restored.append_samples(transitions(8, 1))  # the top priority came back too
    assert restored.tree.leaves(np.array([2]))[0] == 3.0
    uniform = UniformReplayBuffer.create(SPACES, capacity=6)
    uniform.append_samples(transitions(0, 2))
    with pytest.raises(SnapshotError, match="no priorities"):
        restored.load_state_dict(uniform.state_dict())


# ----- n-step transitions -------------------------------------------------------------------------
# Two environments, six steps each, appended as two time-major [3, 2] batches (slot = 2 t + b).
# Environment 0 terminates at t = 1; environment 1 is truncated at t = 1. Observations:
# env 0: 0, 1 | 100, 101, 102, 103 (the episode after the reset); env 1: 200, 201 | 300, ..., 303.
def episode_batches() -> list[dict[str, np.ndarray]]:
    obs = np.array([[0, 200], [1, 201], [100, 300], [101, 301], [102, 302], [103, 303]], dtype=np.float32)
    next_obs = obs + 1
    reward = np.array([[1, 10], [2, 20], [3, 30], [4, 40], [5, 50], [6, 60]], dtype=np.float32)
    terminated = np.zeros((6, 2), dtype=bool)
    truncated = np.zeros((6, 2), dtype=bool)
    terminated[1, 0] = truncated[1, 1] = True
    whole = {
        "observation": obs[..., None], "action": np.zeros((6, 2), dtype=np.int64), "reward": reward,
        "next_observation": next_obs[..., None], "terminated": terminated, "done": terminated | truncated,
    }  # fmt: skip
    return [{k: v[:3] for k, v in whole.items()}, {k: v[3:] for k, v in whole.items()}]


def stored(buffer: UniformReplayBuffer) -> dict[str, np.ndarray]:
    data: dict[str, np.ndarray] = buffer.state_dict()["data"]
    return data


def test_n_step_returns_match_a_hand_computation_with_episode_ends() -> None:
    buffer = UniformReplayBuffer.create(SPACES, capacity=12)
    for batch in episode_batches():
        buffer.append_samples(batch)
    slots = np.array([0, 1, 4, 8, 10, 5])
    out = nstep_transitions(stored(buffer), slots, n_step=3, gamma=0.5, stride=2)
    np.testing.assert_allclose(out["reward"], [
        1 + 0.5 * 2,              # env 0 from t0: stops at the termination at t1
        10 + 0.5 * 20,            # env 1 from t0: stops at the truncation at t1
        3 + 0.5 * 4 + 0.25 * 5,   # env 0 from t2: across the two appends
        5 + 0.5 * 6,              # env 0 from t4: only two steps stored so far
        6,                        # env 0 from t5: the newest step
        30 + 0.5 * 40 + 0.25 * 50,
    ])  # fmt: skip
    np.testing.assert_allclose(out["discount"], [0.25, 0.25, 0.125, 0.25, 0.5, 0.125])
    np.testing.assert_array_equal(out["next_observation"][:, 0], [2, 202, 103, 104, 104, 303])
    # a termination cuts the bootstrap, a truncation keeps it (from the final observation)
    np.testing.assert_array_equal(out["terminated"], [True, False, False, False, False, False])
    np.testing.assert_array_equal(out["observation"][:, 0], [0, 200, 100, 102, 103, 300])
    one = nstep_transitions(stored(buffer), slots, n_step=1, gamma=0.5, stride=2)
    np.testing.assert_array_equal(one["reward"], stored(buffer)["reward"][slots])
    np.testing.assert_array_equal(one["discount"], np.full(6, 0.5, dtype=np.float32))


def test_n_step_chain_stops_where_the_next_slot_is_not_the_next_step() -> None:
    first, second = episode_batches()
    wrapped = UniformReplayBuffer.create(SPACES, capacity=8)  # serials 8..11 overwrite slots 0..3
    wrapped.append_samples(first)
    wrapped.append_samples(second)
    out = nstep_transitions(stored(wrapped), np.array([6, 2]), n_step=3, gamma=0.5, stride=2)
    np.testing.assert_allclose(out["reward"], [4 + 0.5 * 5 + 0.25 * 6, 6])  # through the wrap; overwritten


def test_a_batch_that_does_not_continue_the_stored_steps_cuts_their_episodes() -> None:
    """A resumed run starts new episodes: the last stored step of each environment whose next
    observation is not the new batch's first is marked done, so no n-step chain runs on."""
    first, second = episode_batches()
    buffer = UniformReplayBuffer.create(SPACES, capacity=12)
    buffer.append_samples(first)
    restarted = {k: v.copy() for k, v in second.items()}
    restarted["observation"][0, 0] = restarted["next_observation"][0, 0] = 500  # env 0 was reset
    buffer.append_samples(restarted)
    data = stored(buffer)
    assert data["done"][4] and not data["done"][5] and not data["terminated"][4]  # env 0 cut; env 1 continues
    out = nstep_transitions(data, np.array([4, 5]), n_step=3, gamma=0.5, stride=2)
    np.testing.assert_allclose(out["reward"], [3, 30 + 0.5 * 40 + 0.25 * 50])  # env 0 stops at its cut
    np.testing.assert_allclose(out["discount"], [0.5, 0.125])
    assert out["next_observation"][0, 0] == 101  # the cut step bootstraps from its own next observation


def test_replay_sample_returns_n_step_transitions_with_the_append_stride() -> None:
    buffer = PrioritizedReplayBuffer.create(SPACES, capacity=12)
    for batch in episode_batches():
        buffer.append_samples(batch)
    batch = buffer.sample(64, np.random.default_rng(0), n_step=3, gamma=0.5, beta=0.4)
    expected = nstep_transitions(stored(buffer), batch["index"], n_step=3, gamma=0.5, stride=2)
    for key, value in expected.items():
        np.testing.assert_array_equal(batch[key], value)
