"""PPO actually learns: a short version of `benchmarks/learn_ppo.py` on CartPole-v1."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rlplex.config import validate_config
from rlplex.runners.config import TrainConfig, build_runner, load_train_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_ppo_cartpole_learns_from_the_example_config() -> None:
    data = load_train_config(EXAMPLES / "cartpole_ppo.toml").model_dump()
    data["runner"].update(seed=0, n_steps=40_960, log_interval_steps=4096, stop_at_return=195.0)
    config = validate_config(TrainConfig, data)
    runner = build_runner(config, output_dir=None, show_progress=False)
    result = runner.train()
    evals = [row["charts/eval_return_mean"] for row in result.history]
    # A random CartPole policy averages about 20; 195 is the classic "solved" threshold of v0.
    assert max(evals) >= 195.0, f"eval returns {evals}"
    assert result.target_reached_at_steps is not None and result.target_reached_at_steps <= 40_960
    assert np.isfinite(evals).all()


def test_example_configs_load() -> None:
    for name in ("cartpole_ppo.toml", "pendulum_ppo.toml"):
        config = load_train_config(EXAMPLES / name)
        assert config.runner.kind == "minibatch_eval"
        assert config.runner.n_steps <= 500_000


@pytest.mark.slow
def test_ppo_pendulum_gaussian_agent_beats_random_from_the_example_config() -> None:
    data = load_train_config(EXAMPLES / "pendulum_ppo.toml").model_dump()
    data["runner"].update(seed=0, n_steps=49_152, log_interval_steps=12_288, eval_episodes=4, stop_at_return=-600.0)
    config = validate_config(TrainConfig, data)
    runner = build_runner(config, output_dir=None, show_progress=False)
    result = runner.train()
    evals = [row["charts/eval_return_mean"] for row in result.history]
    # A random Pendulum policy averages about -1200 to -1500; the full benchmark's target is -300.
    # Seeds 0-3 pass -600 at the third or fourth evaluation (-65 to -678 at the third): four
    # evaluations leave room for float-rounding changes that move a seed's trajectory.
    assert max(evals) >= -600.0, f"eval returns {evals}"
    assert np.isfinite(evals).all()
