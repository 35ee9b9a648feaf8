"""Image agents and Atari: the encoder each observation space gets (Nature CNN for images), the
refusals of spaces an agent cannot read, uint8 observations through batches, shared memory
and the replay, the Atari preprocessing (training vs evaluation variants), and CNN DQN / PPO
training on Pong with finite losses and exact resume from a snapshot."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlplex.agents import CategoricalPgAgent, DqnAgent, GaussianPgAgent
from rlplex.algos import DQN, PPO, DQNConfig, PPOConfig
from rlplex.config import validate_config
from rlplex.envs import AtariConfig, EnvConfig, EnvSpaces, make_env, probe_spaces
from rlplex.errors import ConfigError, RlplexError
from rlplex.io.snapshot import read_snapshot, write_snapshot
from rlplex.models.encoders import FlattenEncoder, NatureCnn, nature_cnn_parameters
from rlplex.replays import PrioritizedReplayBuffer, UniformReplayBuffer
from rlplex.runners.config import TrainConfig, build_runner, check_fits_in_memory, check_observation_space
from rlplex.samplers import ParallelSampler, SerialSampler

# Games cut to a few hundred frames: episodes (and evaluations) end within a test's budget.
PONG = EnvConfig(id="ALE/Pong-v5", atari=AtariConfig(), kwargs={"max_num_frames_per_episode": 400})
BREAKOUT = EnvConfig(id="ALE/Breakout-v5", atari=AtariConfig())
IMAGE = EnvSpaces((4, 84, 84), "discrete", 6, (), obs_dtype="uint8")
CARTPOLE = EnvConfig(id="CartPole-v1")


def wrappers(env: gym.Env[Any, Any]) -> list[str]:
    names = []
    while isinstance(env, gym.Wrapper):
        names.append(type(env).__name__)
        env = env.env
    return names


# ----- the Atari environment ---------------------------------------------------------------------
def test_atari_train_and_eval_variants() -> None:
    train, evaluation = make_env(PONG), make_env(PONG, mode="eval")
    try:
        assert train.observation_space == gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
        assert evaluation.observation_space == train.observation_space
        assert {"EpisodicLife", "TransformReward", "AtariPreprocessing", "FrameStackObservation"} <= set(
            wrappers(train)
        )
        # Evaluation plays whole games with the game's own rewards.
        assert "EpisodicLife" not in wrappers(evaluation) and "TransformReward" not in wrappers(evaluation)
        obs, _ = train.reset(seed=3)
        assert obs.dtype == np.uint8 and obs.shape == (4, 84, 84)
        again, _ = make_env(PONG).reset(seed=3)
        np.testing.assert_array_equal(obs, again)  # seeded no-op starts are reproducible
    finally:
        train.close()
        evaluation.close()
    assert probe_spaces(PONG) == dataclasses.replace(IMAGE, frame_stack=4)


def test_episodic_life_ends_the_training_episode_but_not_the_game() -> None:
    env = make_env(BREAKOUT)
    try:
        env.reset(seed=0)
        ale = env.unwrapped.ale  # type: ignore[attr-defined]
        assert ale.lives() == 5
        rng = np.random.default_rng(0)
        for _ in range(5000):
            _, reward, terminated, _, _ = env.step(int(rng.integers(4)))
            assert reward in (-1.0, 0.0, 1.0)
            if terminated:
                break
        assert terminated and ale.lives() == 4  # a lost life, not the game
        env.reset()
        assert ale.lives() == 4  # the game went on instead of restarting
    finally:
        env.close()


def test_atari_config_refuses_kwargs_it_sets() -> None:
    from rlplex.errors import EnvironmentSpecError

    with pytest.raises(EnvironmentSpecError, match=r"field 'env.kwargs': 'frameskip' is set by \[env.atari\]"):
        make_env(EnvConfig(id="ALE/Pong-v5", atari=AtariConfig(), kwargs={"frameskip": 4}))


# ----- encoders --------------------------------------------------------------------------------------
def test_the_encoder_follows_the_observation_space() -> None:
    torch.manual_seed(0)
    agent = CategoricalPgAgent(IMAGE)
    assert isinstance(agent.model.encoder, NatureCnn)
    convs = [m for m in agent.model.encoder.conv if isinstance(m, torch.nn.Conv2d)]
    assert [(c.out_channels, c.kernel_size, c.stride) for c in convs] == [(32, (8, 8), (4, 4)), (64, (4, 4), (2, 2)),
                                                                           (64, (3, 3), (1, 1))]  # fmt: skip
    assert agent.model.encoder.fc.out_features == 512 and agent.model.pi[0].in_features == 512
    assert nature_cnn_parameters(IMAGE) == sum(p.numel() for p in agent.model.encoder.parameters())
    assert CategoricalPgAgent(probe_spaces(CARTPOLE)).model.encoder is None  # the MLP fast path, unchanged

    # uint8 frames are scaled in the model: feeding 255s equals feeding float ones to the layers.
    cnn = agent.model.encoder
    frames = torch.full((2, 4, 84, 84), 255, dtype=torch.uint8)
    torch.testing.assert_close(cnn(frames), torch.relu(cnn.fc(cnn.conv(torch.ones(2, 4, 84, 84)))))
    # Channels-last stacks give the same features as the same frames channels-first.
    last = NatureCnn(4, 84, 84, channels_last=True, single_frame=False)
    last.load_state_dict(cnn.state_dict())
    x = torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8)
    torch.testing.assert_close(last(x.permute(0, 2, 3, 1)), cnn(x))
    hwc = CategoricalPgAgent(EnvSpaces((84, 84, 4), "discrete", 3, (), obs_dtype="uint8"))
    assert isinstance(hwc.model.encoder, NatureCnn) and hwc.model.encoder.channels_last

    # DQN heads over the CNN: plain, dueling and C51 (dueling C51 included).
    obs = np.random.default_rng(0).integers(0, 256, (5, 4, 84, 84), dtype=np.uint8)
    for options, shape in (({}, (5, 6)), ({"dueling": True}, (5, 6)), ({"dueling": True, "n_atoms": 11}, (5, 6, 11))):
        dqn = DqnAgent(IMAGE, **options)
        assert isinstance(dqn.model.encoder, NatureCnn)
        assert dqn.model(torch.as_tensor(obs)).shape == shape
        dqn.set_epsilon(0.0)
        np.testing.assert_array_equal(dqn.step(obs)[0], dqn.eval_step(obs))


def test_multi_dimensional_non_image_boxes_are_flattened() -> None:
    spaces = EnvSpaces((3, 4), "discrete", 2, ())
    agent = CategoricalPgAgent(spaces)
    assert isinstance(agent.model.encoder, FlattenEncoder)
    action, info = agent.step(np.ones((5, 3, 4), dtype=np.float32))
    assert action.shape == (5,) and np.isfinite(info["value"]).all()
    q = DqnAgent(spaces, hidden=(8,), dueling=True)
    assert q.q_values(torch.ones(5, 3, 4)).shape == (5, 2)
    gauss = GaussianPgAgent(EnvSpaces((2, 2), "continuous", 0, (1,), (-1.0,), (1.0,)))
    assert gauss.step(np.zeros((2, 2, 2), dtype=np.float32))[0].shape == (2, 1)


def test_agents_refuse_observations_they_cannot_read() -> None:
    with pytest.raises(ConfigError, match=r"DqnAgent with a CNN encoder needs image observations .* the "
                                          r"observation space is Box\(shape=\(4,\), dtype=float32\)"):  # fmt: skip
        DqnAgent(probe_spaces(CARTPOLE), encoder="cnn")
    with pytest.raises(ConfigError, match=r"at least 36x36 pixels.*Box\(shape=\(4, 16, 16\), dtype=uint8\)"):
        CategoricalPgAgent(EnvSpaces((4, 16, 16), "discrete", 2, (), obs_dtype="uint8"))
    cnn_cartpole = validate_config(TrainConfig, {"env": {"id": "CartPole-v1"}, "agent": {"encoder": "cnn"}})
    with pytest.raises(ConfigError, match=r"field 'agent.encoder': PPO's agent with a CNN encoder needs image "
                                          r"observations.*Box\(shape=\(4,\), dtype=float32\)"):  # fmt: skip
        build_runner(cnn_cartpole, None, show_progress=False)
    sac_on_images = validate_config(
        TrainConfig, {"env": {"id": "Pendulum-v1"}, "agent": {"encoder": "cnn"}, "algo": {"name": "sac"}}
    )
    with pytest.raises(ConfigError, match=r"field 'env': SAC needs a 1-D float Box observation space"):
        build_runner(sac_on_images, None, show_progress=False)


def test_a_replay_of_frames_that_cannot_fit_in_memory_is_refused() -> None:
    config = validate_config(
        TrainConfig, {"env": {"id": "ALE/Pong-v5", "atari": {}}, "algo": {"name": "dqn", "buffer_size": 1_000_000}}
    )
    check_fits_in_memory(config, IMAGE, 64 * 2**30, "pong.toml")  # 52.6 GiB of uint8 frames fit in 64
    expected = r"pong.toml: field 'algo.buffer_size': 1,000,000 transitions of Box\(shape=\(4, 84, 84\), dtype=uint8\)"
    with pytest.raises(ConfigError, match=expected + " observations need 52.6 GiB"):
        check_fits_in_memory(config, IMAGE, 16 * 2**30, "pong.toml")


# ----- uint8 through batches, shared memory and the replay ---------------------------------------------
@pytest.mark.slow
def test_image_observations_stay_uint8_in_batches_shared_memory_and_replay() -> None:
    torch.manual_seed(0)
    agent = DqnAgent(IMAGE)
    serial = SerialSampler(PONG, batch_T=4, batch_B=2)
    serial.initialize(agent, seed=0)
    try:
        batch = serial.obtain_samples(0)
        assert batch.observation.dtype == batch.next_observation.dtype == np.uint8
        assert batch.observation.max() > 0  # real frames were written
    finally:
        serial.shutdown()
    parallel = ParallelSampler(PONG, batch_T=4, batch_B=2, n_workers=2, agent_factory=DqnAgent)
    parallel.initialize(agent, seed=0)
    try:
        shared = parallel.obtain_samples(0)
        assert shared.observation.dtype == shared.next_observation.dtype == np.uint8
        assert shared.observation[:, 1].max() > 0  # the second worker's environment too
    finally:
        parallel.shutdown()
    replay = UniformReplayBuffer.create(IMAGE, capacity=1000, shared=True)
    try:
        arrays = replay._arrays
        assert arrays["observation"].dtype == arrays["next_observation"].dtype == np.uint8
        # 1000 slots of two 4x84x84 frames stacks: 56 MB as uint8 (226 MB as float32).
        assert arrays["observation"].nbytes + arrays["next_observation"].nbytes == 2 * 1000 * 4 * 84 * 84
        replay.append_samples({"observation": batch.observation, "action": batch.action, "reward": batch.reward,
                               "next_observation": batch.next_observation, "terminated": batch.terminated})  # fmt: skip
        sample = replay.sample(3, np.random.default_rng(0))
        assert sample["observation"].dtype == np.uint8
    finally:
        replay.close()


# ----- learning on Pong -----------------------------------------------------------------------------------
def pong_batches(agent: Any, n: int, T: int = 16, B: int = 2) -> list[Any]:
    sampler = SerialSampler(PONG, batch_T=T, batch_B=B)
    sampler.initialize(agent, seed=0)
    try:
        return [sampler.obtain_samples(i).copy() for i in range(n)]
    finally:
        sampler.shutdown()


def make_dqn(seed: int) -> DQN:
    torch.manual_seed(seed)
    config = DQNConfig(batch_size=8, learning_starts=0, updates_per_itr=2, target_update_interval=2, n_step=3,
                       double=True, dueling=True)  # fmt: skip
    algo = DQN(config, seed=seed)
    algo.initialize(DqnAgent(IMAGE, **config.agent_options()), n_itr=10)
    return algo


def test_cnn_dqn_trains_on_pong_and_resumes_exactly(tmp_path: Path) -> None:
    original = make_dqn(0)
    assert original.agent is not None and original.replay is not None
    batches = pong_batches(original.agent, 3)
    for itr in (0, 1):
        metrics = original.optimize_agent(itr, batches[itr])
        assert np.isfinite([metrics["losses/td"], metrics["losses/q_mean"]]).all(), metrics
    assert original.replay._arrays["observation"].dtype == np.uint8
    write_snapshot(tmp_path / "s", {"algo": original.state_dict(), "agent": original.agent.model.state_dict()})
    state = read_snapshot(tmp_path / "s")
    assert state["algo"]["replay"]["data"]["observation"].dtype == np.uint8  # snapshots keep frames as bytes
    resumed = make_dqn(1)
    assert resumed.agent is not None
    resumed.agent.model.load_state_dict(state["agent"])
    resumed.load_state_dict(state["algo"])
    assert original.optimize_agent(2, batches[2]) == resumed.optimize_agent(2, batches[2])
    for key, value in original.agent.model.state_dict().items():
        assert torch.equal(value, resumed.agent.model.state_dict()[key]), key


def make_ppo(seed: int) -> PPO:
    torch.manual_seed(seed)
    algo = PPO(PPOConfig(n_epochs=2, minibatch_size=16, lr_schedule="linear"))
    algo.initialize(CategoricalPgAgent(IMAGE), n_itr=10)
    return algo


def test_cnn_ppo_trains_on_pong_and_resumes_exactly(tmp_path: Path) -> None:
    original = make_ppo(0)
    assert original.agent is not None
    batches = pong_batches(original.agent, 2)
    assert batches[0].observation.dtype == np.uint8
    metrics = original.optimize_agent(0, batches[0])
    assert np.isfinite([metrics["losses/policy"], metrics["losses/value"]]).all(), metrics
    write_snapshot(tmp_path / "s", {"algo": original.state_dict(), "agent": original.agent.model.state_dict()})
    state = read_snapshot(tmp_path / "s")
    resumed = make_ppo(1)
    assert resumed.agent is not None
    resumed.agent.model.load_state_dict(state["agent"])
    resumed.load_state_dict(state["algo"])
    # The minibatch order comes from torch's global generator, which the runner's snapshot restores.
    torch.manual_seed(5)
    expected = original.optimize_agent(1, batches[1])
    torch.manual_seed(5)
    assert resumed.optimize_agent(1, batches[1]) == expected
    for key, value in original.agent.model.state_dict().items():
        assert torch.equal(value, resumed.agent.model.state_dict()[key]), key


def test_recurrent_agents_refuse_image_observations() -> None:
    """The LSTM agents (recurrent PPO/A2C, R2D1) have no CNN: images are refused by name before
    anything is built, not at the first forward pass."""
    spaces = probe_spaces(PONG)
    for algo in ({"name": "r2d1"}, {"name": "ppo"}):
        agent = {} if algo["name"] == "r2d1" else {"lstm_size": 16}
        config = validate_config(
            TrainConfig, {"env": PONG.model_dump(), "algo": algo, "agent": agent, "sampler": {"batch_T": 128}}
        )
        with pytest.raises(ConfigError, match=r"recurrent agent .* 1-D float Box"):
            check_observation_space(config, spaces)


# ----- stacked frames stored once in the replay ---------------------------------------------------
def pong_stream(batches: int, T: int = 40, B: int = 2) -> list[dict[str, np.ndarray]]:
    """Replay appends of real Pong batches (cut at 100 steps: episodes end within them)."""
    sampler = SerialSampler(PONG, batch_T=T, batch_B=B)
    sampler.initialize(CategoricalPgAgent(IMAGE), seed=0)
    out = []
    try:
        for itr in range(batches):
            batch = sampler.obtain_samples(itr)
            samples = {name: getattr(batch, name).copy() for name in ("observation", "action", "reward")}
            samples["next_observation"] = batch.next_observation.copy()
            samples |= {"terminated": batch.terminated.copy(), "done": batch.terminated | batch.truncated}
            out.append(samples)
    finally:
        sampler.shutdown()
    return out


@pytest.mark.parametrize(("kind", "shared"), [("uniform", False), ("prioritized", False), ("uniform", True)])
def test_a_replay_of_frame_stacks_keeps_each_frame_once_and_gives_back_the_same_transitions(
    kind: str, shared: bool
) -> None:
    """Two replays of one stream: whole observations (no stacking known) and two frames a slot
    (frame stacks rebuilt). Every transition the smaller one gives back, one-step and n-step,
    is the whole-observation replay's, across episode ends and a wrapped ring; in shared memory
    (AsyncRl's) as in the process's own."""
    stacked = probe_spaces(PONG)
    assert stacked.frame_stack == 4 and stacked.obs_shape == IMAGE.obs_shape
    assert probe_spaces(CARTPOLE).frame_stack == 1
    cls = PrioritizedReplayBuffer if kind == "prioritized" else UniformReplayBuffer
    made, full = cls.create(stacked, 150, shared=shared), cls.create(IMAGE, 150)
    once = cls.attach(made.handle) if shared else made  # a copier's view: the stack size comes with the handle
    try:
        assert once.stacked and not full.stacked
        frames = 84 * 84 * 150
        assert once._arrays["frame"].nbytes + once._arrays["next_frame"].nbytes == 2 * frames
        stream = pong_stream(5)  # 400 steps into 150 slots: the ring wraps
        assert sum(int(s["done"].sum()) for s in stream) >= 2, "the test needs episode ends in the replay"
        for samples in stream:
            assert once.append_samples(samples) == full.append_samples(samples) == 80

        slots = np.arange(150)
        usable = once._frames().valid(slots)
        # Only the oldest slots of each environment, whose earlier frames the ring overwrote, are out.
        assert 150 - 3 * 2 <= usable.sum() < 150
        for n_step, gamma in ((1, None), (3, 0.99)):
            want = full._gather(slots, n_step, gamma)
            got = once._gather(slots[usable], n_step, gamma)
            for name in want:
                assert np.array_equal(got[name], want[name][usable]), (n_step, name)

        rng = np.random.default_rng(1)
        for _ in range(20):  # sampling never gives a slot whose frames are gone
            drawn = once.sample(64, rng, 3, 0.99)
            observations = full._gather(slots[usable], 1, None)["observation"].reshape(int(usable.sum()), -1)
            known = {row.tobytes() for row in observations}
            assert all(row.tobytes() in known for row in drawn["observation"].reshape(64, -1))

        state = once.state_dict()
        assert "frame" in state["data"] and "observation" not in state["data"]
        again = cls.create(stacked, 150)
        again.load_state_dict(state)
        a, b = once.sample(32, np.random.default_rng(2)), again.sample(32, np.random.default_rng(2))
        assert all(np.array_equal(a[name], b[name]) for name in a)
        # A snapshot of an older rlplex, which kept whole stacks, loads.
        older = {**state, "data": {k: v for k, v in state["data"].items() if k != "frame"}}
        older["data"]["observation"] = full.state_dict()["data"]["observation"]
        converted = cls.create(stacked, 150)
        converted.load_state_dict(older)
        assert np.array_equal(converted._gather(slots[usable], 1, None)["observation"], want["observation"][usable])
    finally:
        for replay in (once, made, full):
            replay.close()


def test_a_resumed_stream_of_new_episodes_is_stored_as_such() -> None:
    """A resumed run's environments start new episodes: the replay cuts the stored episodes
    (their last steps become done) and the new stacks are episode starts, not a mismatch."""
    stacked = probe_spaces(PONG)
    replay, full = UniformReplayBuffer.create(stacked, 64), UniformReplayBuffer.create(IMAGE, 64)
    before, restarted = pong_stream(1, T=8, B=2)[0], pong_stream(1, T=8, B=2)[0]  # a fresh sampler: reset stacks
    for samples in (before, restarted):
        replay.append_samples(samples)
        full.append_samples(samples)
    assert replay._arrays["done"][14:16].all() and not replay._arrays["terminated"][14:16].any()
    slots = np.arange(32)
    assert replay._frames().valid(slots).all()
    for n_step, gamma in ((1, None), (3, 0.99)):
        got, want = replay._gather(slots, n_step, gamma), full._gather(slots, n_step, gamma)
        for name in want:
            assert np.array_equal(got[name], want[name]), (n_step, name)


def test_frames_once_refuses_a_stream_it_cannot_rebuild() -> None:
    """An episode whose first stack does not repeat its first frame (another padding), or steps
    out of order, would be rebuilt wrong: the append is refused, not the sample silently wrong."""
    stacked = probe_spaces(PONG)
    replay = UniformReplayBuffer.create(stacked, 64)
    samples = pong_stream(1, T=8, B=2)[0]
    samples["observation"][0, :, 0] = 0  # zero padding in the first stack
    with pytest.raises(RlplexError, match=r"does not follow from the frames before it.*padding_type='reset'"):
        replay.append_samples(samples)
    replay = UniformReplayBuffer.create(stacked, 64)
    first, _, third = pong_stream(3, T=8, B=2)
    replay.append_samples(first)
    with pytest.raises(RlplexError, match=r"steps must arrive in order"):
        replay.append_samples(third)  # a batch left out: its stacks need frames never stored


def test_the_memory_check_counts_two_frames_a_slot_for_frame_stacks() -> None:
    config = validate_config(
        TrainConfig, {"env": {"id": "ALE/Pong-v5", "atari": {}}, "algo": {"name": "dqn", "buffer_size": 1_000_000}}
    )
    stacked = EnvSpaces((4, 84, 84), "discrete", 6, (), obs_dtype="uint8", frame_stack=4)
    check_fits_in_memory(config, stacked, 16 * 2**30, "pong.toml")  # 13.1 GiB: each step's frame and the next one's
    with pytest.raises(ConfigError, match=r"observations need 13\.1 GiB"):
        check_fits_in_memory(config, stacked, 8 * 2**30, "pong.toml")
