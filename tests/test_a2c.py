"""A2C on CartPole-v1: the direction of one update, exact resume, the config, and learning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rlplex.agents import CategoricalPgAgent
from rlplex.algos import A2C, A2CConfig
from rlplex.config import validate_config
from rlplex.envs import EnvConfig, probe_spaces
from rlplex.errors import ConfigError, RlplexError
from rlplex.io.snapshot import read_snapshot, write_snapshot
from rlplex.runners import MinibatchRlEval
from rlplex.runners.config import TrainConfig, build_algo
from rlplex.samplers import Evaluator, SerialSampler
from rlplex.samplers.batch import SampleBatch

CARTPOLE = EnvConfig(id="CartPole-v1")


def cartpole_batches(agent: CategoricalPgAgent, n: int) -> list[SampleBatch]:
    """Real CartPole-v1 batches sampled by `agent` (with its log-probs and values), copied."""
    sampler = SerialSampler(CARTPOLE, batch_T=5, batch_B=4)
    sampler.initialize(agent, seed=0)
    try:
        return [sampler.obtain_samples(i).copy() for i in range(n)]
    finally:
        sampler.shutdown()


def make_a2c(seed: int, **config: object) -> A2C:
    torch.manual_seed(seed)
    algo = A2C(A2CConfig.model_validate(config))
    algo.initialize(CategoricalPgAgent(probe_spaces(CARTPOLE), hidden=(16,)), n_itr=10)
    return algo


def test_one_update_makes_actions_with_positive_advantage_more_likely() -> None:
    algo = make_a2c(0, value_coef=0.0, learning_rate=1e-2)
    assert algo.agent is not None
    batch = cartpole_batches(algo.agent, 1)[0]
    # Rewards far above the critic's values: every advantage is positive.
    batch.reward[:] = 100.0
    obs, action = torch.as_tensor(batch.observation.reshape(-1, 4)), torch.as_tensor(batch.action.reshape(-1))
    before = algo.agent.evaluate(obs, action)[0].detach()
    metrics = algo.optimize_agent(0, batch)
    after = algo.agent.evaluate(obs, action)[0].detach()
    assert float((after - before).mean()) > 0 and metrics["losses/policy"] > 0  # -adv * log p, log p < 0
    assert algo.update_count == 1


@pytest.mark.parametrize("optimizer", ["rmsprop", "adam"])
def test_resume_from_a_snapshot_equals_the_uninterrupted_run(optimizer: str, tmp_path: Path) -> None:
    uninterrupted = make_a2c(0, optimizer=optimizer, lr_schedule="linear")
    assert uninterrupted.agent is not None
    batches = cartpole_batches(uninterrupted.agent, 4)
    for itr in (0, 1):
        uninterrupted.optimize_agent(itr, batches[itr])
    write_snapshot(
        tmp_path / "s", {"algo": uninterrupted.state_dict(), "agent": uninterrupted.agent.model.state_dict()}
    )
    state = read_snapshot(tmp_path / "s")
    resumed = make_a2c(1, optimizer=optimizer, lr_schedule="linear")  # other weights until loaded
    assert resumed.agent is not None
    resumed.agent.model.load_state_dict(state["agent"])
    resumed.load_state_dict(state["algo"])
    for itr in (2, 3):
        assert uninterrupted.optimize_agent(itr, batches[itr]) == resumed.optimize_agent(itr, batches[itr])
    for key, value in uninterrupted.agent.model.state_dict().items():
        assert torch.equal(value, resumed.agent.model.state_dict()[key]), key
    assert resumed.update_count == uninterrupted.update_count == 4


def test_config_builds_a2c_and_rejects_ppo_fields() -> None:
    config = validate_config(TrainConfig, {"env": {"id": "CartPole-v1"}, "algo": {"name": "a2c", "gamma": 0.9}})
    algo = build_algo(config)
    assert isinstance(algo, A2C) and algo.config.gamma == 0.9
    with pytest.raises(ConfigError, match="clip_range"):
        validate_config(TrainConfig, {"env": {"id": "CartPole-v1"}, "algo": {"name": "a2c", "clip_range": 0.2}})
    with pytest.raises(RlplexError, match="on-policy"):
        make_a2c(0).optimize_agent(0, None)


def test_a2c_learns_cartpole_beyond_random_in_a_small_budget() -> None:
    """Smoke version of `benchmarks.classic_learning --algo a2c`: a random policy scores about 20."""
    torch.manual_seed(0)
    spaces = probe_spaces(CARTPOLE)
    runner = MinibatchRlEval(
        A2C(A2CConfig()), CategoricalPgAgent(spaces), SerialSampler(CARTPOLE, 5, 8),
        n_steps=20_000, seed=0, log_interval_steps=2000, snapshot_mode="none", stop_at_return=150.0,
        show_progress=False, evaluator=Evaluator(CARTPOLE, n_episodes=5, seed=0),
    )  # fmt: skip
    result = runner.train()
    returns = [row["charts/eval_return_mean"] for row in result.history]
    assert max(returns) >= 150.0 and np.isfinite(returns).all(), returns


@pytest.mark.slow
def test_classic_learning_benchmark_prints_a_table_and_writes_json_and_png(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'src'}"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.classic_learning", "--algo", "a2c", "--seeds", "1", "--n-steps", "400"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "A2C (cartpole_a2c.toml): 0/1 seeds reached 475.0" in done.stdout
    summary = json.loads((tmp_path / "bench_results" / "classic_a2c.json").read_text())
    assert summary["passed"] == 0 and summary["seeds"][0]["env_steps"] == 400
    assert (tmp_path / "bench_results" / "classic_a2c.png").read_bytes()[:4] == b"\x89PNG"
