"""`[sampler] kind = "envpool"`: EnvPool's C++ threads step the environments with the batch
semantics of the other samplers (an ended episode's terminal observation in
`next_observation`, the new episode's first in the next `observation`), Atari preprocessing
from `[env.atari]`, resume with new seeds, and training under MinibatchRl and AsyncRl."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rlplex.agents import RandomAgent
from rlplex.envs import AtariConfig, EnvConfig, probe_spaces
from rlplex.errors import EnvironmentSpecError
from rlplex.runners.config import TrainConfig, build_runner
from rlplex.samplers.batch import SampleBatch

pytest.importorskip("envpool")

from rlplex.samplers.envpool_ import EnvPoolSampler

CARTPOLE = EnvConfig(id="CartPole-v1")
PONG = EnvConfig(id="ALE/Pong-v5", atari=AtariConfig(), kwargs={"max_num_frames_per_episode": 400})


def sample(env: EnvConfig, batches: int, state: dict[str, Any] | None = None, T: int = 64, B: int = 4) -> Any:
    sampler = EnvPoolSampler(env, batch_T=T, batch_B=B)
    try:
        sampler.initialize(RandomAgent(probe_spaces(env), seed=0), seed=7)
        if state is not None:
            sampler.load_state_dict(state)
        copies = [copy_batch(sampler.obtain_samples(itr)) for itr in range(batches)]
        return copies, sampler.state_dict()
    finally:
        sampler.shutdown()


def copy_batch(batch: SampleBatch) -> dict[str, np.ndarray]:
    return {name: array.copy() for name, array in batch.arrays()}


def test_cartpole_batches_continue_episodes_and_reset_where_they_end() -> None:
    (first, second), _ = sample(CARTPOLE, 2)
    ended = first["terminated"] | first["truncated"]
    assert ended.sum() >= 4, "random CartPole episodes last about 20 steps"
    lengths = first["completed_length"][ended]
    assert (lengths >= 8).all() and (lengths <= 200).all(), lengths
    assert np.isnan(first["completed_return"][~ended]).all()
    going = ~ended[:-1]
    # A step that did not end an episode: the next observation is where the next step starts.
    assert np.array_equal(first["next_observation"][:-1][going], first["observation"][1:][going])
    # One that did: a new episode starts near the upright rest state, not where the pole fell.
    restarted = first["observation"][1:][ended[:-1]]
    assert (np.abs(restarted) <= 0.05).all()
    assert (np.abs(first["next_observation"][:-1][ended[:-1]][:, 2]) > 0.2).any()  # fell over
    continuing = ~ended[-1]
    assert np.array_equal(second["observation"][0][continuing], first["next_observation"][-1][continuing])


def test_atari_frames_are_stacked_uint8_from_the_atari_config() -> None:
    (batch,), _ = sample(PONG, 1, T=32, B=2)
    assert batch["observation"].dtype == np.uint8 and batch["observation"].shape == (32, 2, 4, 84, 84)
    going = ~(batch["terminated"] | batch["truncated"])[:-1]
    # The stack moves by one frame a step: the newest three frames become the oldest three.
    assert np.array_equal(batch["observation"][1:, :, :3][going], batch["observation"][:-1, :, 1:][going])
    assert set(np.unique(batch["reward"])) <= {-1.0, 0.0, 1.0}  # clipped for training


def test_a_resumed_sampler_reseeds_deterministically_and_never_repeats_the_first_run() -> None:
    (first,), state = sample(CARTPOLE, 1)
    assert all(isinstance(seed, int) for seed in state["envs"]) and len(state["envs"]) == 4
    (resumed_a,), _ = sample(CARTPOLE, 1, state)
    (resumed_b,), _ = sample(CARTPOLE, 1, state)
    assert np.array_equal(resumed_a["observation"], resumed_b["observation"])  # same state, same streams
    assert not np.array_equal(resumed_a["observation"][0], first["observation"][0])  # new episodes


def test_a_task_envpool_lacks_is_refused_naming_the_field() -> None:
    sampler = EnvPoolSampler(EnvConfig(id="rlplex/CartPoleNoVel-v1"), batch_T=4, batch_B=2)
    with pytest.raises(EnvironmentSpecError, match=r"field 'env\.id': EnvPool has no task 'rlplex/CartPoleNoVel-v1'"):
        sampler.initialize(RandomAgent(probe_spaces(EnvConfig(id="rlplex/CartPoleNoVel-v1"))), seed=0)


PPO = {"name": "ppo", "n_epochs": 2, "minibatch_size": 64}


@pytest.mark.slow
@pytest.mark.parametrize(("algo", "runner"), [(PPO, "minibatch"), ({"name": "dqn"}, "async")])
def test_training_runs_on_the_envpool_sampler(algo: dict[str, Any], runner: str, tmp_path: Path) -> None:
    config = TrainConfig.model_validate(
        {
            "env": {"id": "CartPole-v1"},
            "sampler": {"kind": "envpool", "batch_T": 32, "batch_B": 4},
            "algo": algo,
            "runner": {"kind": runner, "n_steps": 1024, "log_interval_steps": 512},
        }
    )
    result = build_runner(config, tmp_path, show_progress=False).train()
    assert result.env_steps >= 1024
    assert (tmp_path / "progress.csv").is_file()
