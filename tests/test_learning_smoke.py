"""PPO actually learns: a short version of `benchmarks/learn_ppo.py` on CartPole-v1."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from rlplex.config import validate_config
from rlplex.runners.config import TrainConfig, build_runner, load_train_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_ppo_cartpole_learns_from_the_example_config() -> None:
    data = load_train_config(EXAMPLES / "cartpole_ppo.toml").model_dump()
    data["runner"].update(seed=0, n_steps=40_960, log_interval_steps=4096, stop_at_return=195.0)
    config = validate_config(TrainConfig, data)
    runner = build_runner(config, output_dir=None, show_progress=False)
    t0 = time.perf_counter()
    result = runner.train()
    elapsed = time.perf_counter() - t0
    evals = [row["charts/eval_return_mean"] for row in result.history]
    # A random CartPole policy averages about 20; 195 is the classic "solved" threshold of v0.
    assert max(evals) >= 195.0, f"eval returns {evals}"
    assert result.target_reached_at_steps is not None and result.target_reached_at_steps <= 40_960
    assert np.isfinite(evals).all()
    assert elapsed < 60.0


def test_example_configs_load() -> None:
    for name in ("cartpole_ppo.toml", "pendulum_ppo.toml"):
        config = load_train_config(EXAMPLES / name)
        assert config.runner.kind == "minibatch_eval"
        assert config.runner.n_steps <= 500_000
