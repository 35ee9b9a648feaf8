from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rlplex.agents import CategoricalPgAgent
from rlplex.algos import PPO, PPOConfig
from rlplex.diagnostics.metrics import read_metrics_csv
from rlplex.envs import EnvConfig, probe_spaces
from rlplex.errors import SnapshotError
from rlplex.io.snapshot import latest_snapshot, list_snapshots, read_snapshot
from rlplex.runners import MinibatchRl, MinibatchRlEval
from rlplex.samplers import Evaluator, SerialSampler


def make_runner(
    env: EnvConfig, log_dir: Path, n_steps: int, batch_B: int = 4, log_interval_steps: int = 128, **kwargs: object
) -> MinibatchRl:
    agent = CategoricalPgAgent(probe_spaces(env))
    algo = PPO(PPOConfig(n_epochs=2, minibatch_size=64))
    sampler = SerialSampler(env, batch_T=32, batch_B=batch_B)
    return MinibatchRl(
        algo,
        agent,
        sampler,
        n_steps=n_steps,
        log_interval_steps=log_interval_steps,
        log_dir=log_dir,
        show_progress=False,
        **kwargs,
    )


def test_minibatch_logs_namespaced_diagnostics(tmp_path: Path, cartpole: EnvConfig) -> None:
    result = make_runner(cartpole, tmp_path, n_steps=1024).train()
    assert result.env_steps == 1024
    rows = read_metrics_csv(tmp_path / "progress.csv")
    assert len(rows) == 8
    for key in ("charts/env_steps_per_s", "charts/online_return_mean", "losses/policy", "charts/wall_time_s"):
        assert key in rows[-1]
    assert (tmp_path / "tb").is_dir()


def test_resume_continues_counters_parameters_and_optimizer(tmp_path: Path, cartpole: EnvConfig) -> None:
    first = make_runner(cartpole, tmp_path, n_steps=512, snapshot_mode="all")
    first.train()
    snapshots = list_snapshots(tmp_path / "snapshots")
    assert [i for i, _ in snapshots] == [0, 1, 2, 3]
    saved = read_snapshot(snapshots[1][1])  # after iteration 1

    resumed = make_runner(cartpole, tmp_path, n_steps=1024, snapshot_mode="all")
    resumed.resume_from(snapshots[1][1])
    resumed.startup()
    try:
        for key, value in resumed.agent.model.state_dict().items():
            assert torch.equal(value, saved["agent"][key]), key
        algo_state = resumed.algo.state_dict()
        assert algo_state["update_count"] == saved["algo"]["update_count"]
        # Optimizer state by parameter name, every parameter's moments restored.
        state, saved_state = algo_state["optimizer"]["state"], saved["algo"]["optimizer"]["state"]
        assert set(state) == {name for name, _ in resumed.agent.model.named_parameters()} == set(saved_state)
        for name, values in state.items():
            assert torch.equal(values["exp_avg"], saved_state[name]["exp_avg"]), name
        # The random streams continue where the snapshot left them.
        assert resumed.start_itr == 2
    finally:
        resumed.shutdown()

    again = make_runner(cartpole, tmp_path, n_steps=1024, snapshot_mode="all")
    again.resume_from(latest_snapshot(tmp_path / "snapshots"))
    result = again.train()
    assert result.itr == 7 and result.env_steps == 1024
    steps = [r["step"] for r in read_metrics_csv(tmp_path / "progress.csv")]
    assert steps[-1] == 1024 and steps == sorted(steps)


def test_a_resume_with_more_steps_keeps_the_schedules_where_they_were(tmp_path: Path, cartpole: EnvConfig) -> None:
    def runner(n_steps: int, **kwargs: object) -> MinibatchRl:
        agent = CategoricalPgAgent(probe_spaces(cartpole))
        algo = PPO(PPOConfig(n_epochs=1, minibatch_size=128, lr_schedule="linear", learning_rate=1e-3))
        sampler = SerialSampler(cartpole, batch_T=32, batch_B=4)
        return MinibatchRl(algo, agent, sampler, n_steps, log_interval_steps=128, show_progress=False, **kwargs)

    first = runner(512, log_dir=tmp_path / "a")
    lrs = [row["charts/learning_rate"] for row in first.train().history]
    assert lrs == pytest.approx([1e-3, 0.75e-3, 0.5e-3, 0.25e-3])
    snapshot = latest_snapshot(tmp_path / "a" / "snapshots")

    # Twice the steps: the decay goes on over the first run's 4 iterations (it stays at zero).
    longer = runner(1024)
    longer.resume_from(snapshot)
    assert [row["charts/learning_rate"] for row in longer.train().history] == pytest.approx([0.0] * 4)
    # A new horizon given: the schedule is recomputed over it (8 iterations).
    rescheduled = runner(1024, schedule_steps=1024)
    rescheduled.resume_from(snapshot)
    lrs = [row["charts/learning_rate"] for row in rescheduled.train().history]
    assert lrs == pytest.approx([0.5e-3, 0.375e-3, 0.25e-3, 0.125e-3])


def test_gap_snapshots_are_written_when_the_gap_equals_the_log_interval(tmp_path: Path, cartpole: EnvConfig) -> None:
    # 128 steps per iteration: a log row, and a snapshot, every 2 iterations.
    make_runner(cartpole, tmp_path, 512, log_interval_steps=256, snapshot_mode="gap", snapshot_gap=2).train()
    assert [i for i, _ in list_snapshots(tmp_path / "snapshots")] == [1, 3]


def test_resume_from_incompatible_config_refused(tmp_path: Path, cartpole: EnvConfig) -> None:
    make_runner(cartpole, tmp_path, n_steps=256).train()
    other = make_runner(cartpole, tmp_path / "other", n_steps=512, batch_B=8)
    with pytest.raises(SnapshotError, match="incompatible config"):
        other.resume_from(latest_snapshot(tmp_path / "snapshots"))


def test_eval_runner_stops_at_target(tmp_path: Path, cartpole: EnvConfig) -> None:
    agent = CategoricalPgAgent(probe_spaces(cartpole))
    runner = MinibatchRlEval(
        PPO(PPOConfig(n_epochs=1)),
        agent,
        SerialSampler(cartpole, 16, 2),
        n_steps=10_000,
        log_interval_steps=64,
        evaluator=Evaluator(cartpole, n_episodes=2),
        stop_at_return=1.0,  # any episode reaches this: the first evaluation stops the run
        show_progress=False,
    )
    result = runner.train()
    assert result.target_reached_at_steps == 64 and result.env_steps == 64
    assert np.isfinite(result.history[0]["charts/eval_return_mean"])


def test_build_runner_fixes_the_initial_weights_by_the_seed() -> None:
    """`runner.seed` alone fixes a run: the agent's initial weights must not depend on the state
    of torch's global generator, which a process starts with a random seed."""
    from rlplex.runners.config import build_runner, load_train_config

    config = load_train_config(Path(__file__).resolve().parent.parent / "examples" / "cartpole_ppo.toml")
    data = config.model_dump()

    def initial_weights(seed: int, global_seed: int) -> list[torch.Tensor]:
        torch.manual_seed(global_seed)  # stands for whatever state the process is in
        data["runner"].update(seed=seed)
        runner = build_runner(type(config).model_validate(data), output_dir=None, show_progress=False)
        return [p.detach().clone() for p in runner.agent.model.parameters()]

    first, again, other = initial_weights(3, 100), initial_weights(3, 200), initial_weights(4, 100)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
