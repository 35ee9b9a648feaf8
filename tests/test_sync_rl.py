"""SyncRl / SyncRlEval: real spawned ranks in a real gloo group of world size 2, tiny budgets."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch

from rlplex.agents import CategoricalPgAgent
from rlplex.algos import PPO, PPOConfig
from rlplex.diagnostics.metrics import read_metrics_csv
from rlplex.envs import EnvConfig, probe_spaces
from rlplex.errors import SnapshotError, WorkerDiedError
from rlplex.io.snapshot import latest_snapshot, read_snapshot
from rlplex.runners import SyncLauncher, SyncRl, TrainResult
from rlplex.runners.config import TrainConfig, build_runner, build_sync_rank
from rlplex.samplers import Evaluator, SerialSampler
from rlplex.samplers.batch import SampleBatch

CARTPOLE = EnvConfig(id="CartPole-v1")


def tiny_config(kind: str, n_steps: int, **runner: Any) -> TrainConfig:
    return TrainConfig.model_validate(
        {
            "env": {"id": "CartPole-v1"},
            "sampler": {"batch_T": 32, "batch_B": 2},
            "algo": {"name": "ppo", "n_epochs": 2, "minibatch_size": 32},
            "runner": {"kind": kind, "n_steps": n_steps, "log_interval_steps": 256, "world_size": 2, **runner},
        }
    )


# ----- rank builders (module level: they are pickled into spawned ranks) -----------------------
def build_seeded(config: TrainConfig, output_dir: str, rank: int, world_size: int) -> Any:
    """Ranks build different initial weights, so identical ones at start prove the broadcast."""
    torch.manual_seed(1000 + rank)
    return build_sync_rank(config, output_dir, False, rank, world_size)


class ExplodingEvaluator(Evaluator):
    def evaluate(self, agent: Any) -> tuple[np.ndarray, np.ndarray]:
        raise AssertionError("evaluation ran on a rank other than 0")


def build_eval_rank0_only(config: TrainConfig, output_dir: str, rank: int, world_size: int) -> Any:
    runner = build_sync_rank(config, output_dir, False, rank, world_size)
    if rank != 0:
        runner.evaluator.close()
        runner.evaluator = ExplodingEvaluator(config.env, n_episodes=1)
    return runner


class FaultySampler(SerialSampler):
    """Fails on rank 1 at iteration `at_itr`: SIGKILL (after writing the time) or an exception."""

    def __init__(self, fault: str, marker: str, at_itr: int = 3) -> None:
        super().__init__(CARTPOLE, batch_T=32, batch_B=2)
        self.fault, self.marker, self.at_itr = fault, marker, at_itr

    def obtain_samples(self, itr: int) -> SampleBatch:
        if itr == self.at_itr:
            if self.fault == "kill":
                Path(self.marker).write_text(json.dumps({"killed_at": time.time()}))
                os.kill(os.getpid(), signal.SIGKILL)
            if self.fault == "user":
                raise SnapshotError(f"bad input at itr {itr}")
            raise ValueError(f"boom at itr {itr}")
        return super().obtain_samples(itr)


def build_faulty(fault: str, marker: str, rank: int, world_size: int) -> SyncRl:
    sampler = SerialSampler(CARTPOLE, 32, 2) if rank == 0 else FaultySampler(fault, marker)
    agent = CategoricalPgAgent(probe_spaces(CARTPOLE))
    algo = PPO(PPOConfig(n_epochs=1, minibatch_size=32))
    return SyncRl(algo, agent, sampler, n_steps=10_000_000, show_progress=False, rank=rank, world_size=world_size)


def listening(process: psutil.Process) -> list[tuple[int, str, int]]:
    return [
        (process.pid, c.laddr.ip, c.laddr.port)
        for c in process.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]


class SocketProbeSampler(SerialSampler):
    """On rank 0 at iteration 1 (every rank is in the group then), write the listening sockets of
    the launcher and of each of its processes to `marker`."""

    def __init__(self, marker: str) -> None:
        super().__init__(CARTPOLE, batch_T=32, batch_B=2)
        self.marker = marker

    def obtain_samples(self, itr: int) -> SampleBatch:
        if itr == 1:
            launcher = psutil.Process(multiprocessing.parent_process().pid)  # type: ignore[union-attr]
            found = [s for p in [launcher, *launcher.children(recursive=True)] for s in listening(p)]
            Path(self.marker).write_text(json.dumps({"launcher": launcher.pid, "sockets": found}))
        return super().obtain_samples(itr)


def build_probed(marker: str, rank: int, world_size: int) -> SyncRl:
    sampler = SocketProbeSampler(marker) if rank == 0 else SerialSampler(CARTPOLE, 32, 2)
    agent = CategoricalPgAgent(probe_spaces(CARTPOLE))
    algo = PPO(PPOConfig(n_epochs=1, minibatch_size=32))
    return SyncRl(algo, agent, sampler, n_steps=384, show_progress=False, rank=rank, world_size=world_size)


# ----- tests -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SyncLauncher, TrainResult]:
    out = tmp_path_factory.mktemp("sync")
    launcher = SyncLauncher(partial(build_seeded, tiny_config("sync", 1024), str(out)), world_size=2, timeout_s=120)
    return out, launcher, launcher.train()


@pytest.mark.slow
def test_ranks_start_equal_and_stay_in_sync(first_run: tuple[Path, SyncLauncher, TrainResult]) -> None:
    _, launcher, result = first_run
    assert result.env_steps == 1024  # 32 x 2 per rank x 2 ranks = 128 per iteration, 8 iterations
    r0, r1 = (o.digests or {} for o in launcher.rank_outcomes)
    assert r0["built"] != r1["built"], "the test builder should give the ranks different initial weights"
    assert r0["start"] == r1["start"] == r0["built"], "DDP should broadcast rank 0's weights"
    assert r0["final"] == r1["final"], "all-reduced gradients should keep the replicas identical"
    assert r0["final"] != r0["start"], "training should change the weights"


def test_rank0_log_holds_the_episodes_of_every_rank(first_run: tuple[Path, SyncLauncher, TrainResult]) -> None:
    out, launcher, result = first_run
    local = [o.local_episodes for o in launcher.rank_outcomes]
    assert min(local) > 0
    rows = read_metrics_csv(out / "progress.csv")
    assert len(rows) == len(result.history) == 4
    assert sum(row["charts/episodes"] for row in rows) == sum(local)


@pytest.fixture(scope="module")
def resumed_eval_run(
    tmp_path_factory: pytest.TempPathFactory, first_run: tuple[Path, SyncLauncher, TrainResult]
) -> tuple[int, SyncLauncher, TrainResult]:
    """Resumes `first_run` as SyncRlEval; any return reaches the target, so the first log row stops it."""
    out = first_run[0]
    snapshot = latest_snapshot(out / "snapshots")
    config = tiny_config("sync_eval", 100_000, eval_episodes=2, stop_at_return=0.0)
    launcher = SyncLauncher(partial(build_eval_rank0_only, config, str(tmp_path_factory.mktemp("resumed"))))
    launcher.timeout_s = 120
    launcher.resume_from(snapshot)
    return int(read_snapshot(snapshot)["itr"]), launcher, launcher.train()


@pytest.mark.slow
def test_resume_continues_the_step_counter_from_rank0s_snapshot(
    first_run: tuple[Path, SyncLauncher, TrainResult], resumed_eval_run: tuple[int, SyncLauncher, TrainResult]
) -> None:
    saved_itr, launcher, result = resumed_eval_run
    assert saved_itr == 7
    # Iterations 8 and 9 run (128 steps each); the log row after them stops the run.
    assert [row["charts/env_steps"] for row in result.history] == [1280.0]
    final_before = (first_run[1].rank_outcomes[0].digests or {})["final"]
    assert {(o.digests or {})["start"] for o in launcher.rank_outcomes} == {final_before}


def test_sync_eval_evaluates_on_rank0_and_stops_all_ranks_together(
    resumed_eval_run: tuple[int, SyncLauncher, TrainResult],
) -> None:
    _, launcher, result = resumed_eval_run  # rank 1 has an evaluator that raises if called
    assert result.target_reached_at_steps == 1280
    assert "charts/eval_return_mean" in result.history[0]
    assert [o.result["env_steps"] for o in launcher.rank_outcomes if o.result] == [1280, 1280]


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "raise"])
def test_a_failed_rank_ends_the_run_without_orphans(tmp_path: Path, fault: str) -> None:
    marker = tmp_path / "killed.json"
    launcher = SyncLauncher(partial(build_faulty, fault, str(marker)), collective_timeout_s=30, timeout_s=120)
    with pytest.raises(WorkerDiedError) as caught:
        launcher.train()
    noticed_at = time.time()
    message = str(caught.value)
    assert message.startswith("rank 1 ")
    if fault == "kill":
        assert "exit code -9" in message
        assert noticed_at - json.loads(marker.read_text())["killed_at"] < 5.0
    else:
        assert "exit code 1" in message and "ValueError: boom at itr 3" in message
    _assert_no_rank_left(launcher)


@pytest.mark.slow
def test_a_user_error_in_a_rank_keeps_its_class(tmp_path: Path) -> None:
    # A bad input found inside a rank is the user's to fix (rlplex train: exit 2), not a failed run.
    launcher = SyncLauncher(partial(build_faulty, "user", ""), collective_timeout_s=30, timeout_s=120)
    with pytest.raises(SnapshotError, match=r"^rank 1: bad input at itr 3$"):
        launcher.train()
    _assert_no_rank_left(launcher)


def _assert_no_rank_left(launcher: SyncLauncher) -> None:
    for process in launcher.processes:
        assert not process.is_alive()
        with pytest.raises(ProcessLookupError):
            os.kill(process.pid or -1, 0)


def test_config_builds_a_launcher_and_global_batch_divides_per_rank_sizes(tmp_path: Path) -> None:
    launcher = build_runner(tiny_config("sync", 1024, world_size=2, global_batch=True), tmp_path)
    assert isinstance(launcher, SyncLauncher) and launcher.world_size == 2
    runner = launcher.build(1, 2)
    assert isinstance(runner, SyncRl)
    assert runner.sampler.batch_B == 1 and runner.algo.config.minibatch_size == 16  # type: ignore[attr-defined]
    assert runner.itr_batch_size == 64  # the global batch of the config: 32 x 2


@pytest.mark.slow
def test_snapshots_resume_across_minibatch_and_sync_with_the_optimizer_state(tmp_path: Path) -> None:
    # 128 samples per iteration either way: one process with 4 envs, or 2 ranks with 2 each.
    def config(kind: str, n_steps: int, batch_B: int) -> TrainConfig:
        data = tiny_config(kind, n_steps).model_dump()
        data["sampler"]["batch_B"] = batch_B
        return TrainConfig.model_validate(data)

    single = build_runner(config("minibatch", 256, 4), tmp_path / "single", show_progress=False)
    single.train()
    # The optimizer state is saved by parameter name, whatever tensors Adam holds in each runner.
    assert len(single.algo.optimizer.param_groups[0]["params"]) == len(list(single.agent.model.parameters()))
    launcher = build_runner(config("sync", 512, 2), tmp_path / "ranks", show_progress=False)
    launcher.timeout_s = 120
    launcher.resume_from(latest_snapshot(tmp_path / "single" / "snapshots"))
    assert launcher.train().env_steps == 512
    ranks_snapshot = latest_snapshot(tmp_path / "ranks" / "snapshots")
    saved = read_snapshot(ranks_snapshot)["algo"]["optimizer"]["state"]

    back = build_runner(config("minibatch", 640, 4), tmp_path / "back", show_progress=False)
    back.resume_from(ranks_snapshot)
    back.startup()
    try:
        for name, parameter in back.agent.model.named_parameters():
            state = back.algo.optimizer.state[parameter]
            assert torch.equal(state["exp_avg"], saved[name]["exp_avg"].reshape(parameter.shape)), name
            assert float(state["step"]) == float(saved[name]["step"]) == 16 + 8
    finally:
        back.shutdown()


@pytest.mark.slow
def test_every_port_of_a_sync_run_is_on_loopback(tmp_path: Path) -> None:
    marker = tmp_path / "sockets.json"
    before = set(listening(psutil.Process()))  # this test process's own (it is the launcher)
    # Processes earlier tests left running under this one (a session's Ray, say) are not the run's.
    earlier = {child.pid for child in psutil.Process().children(recursive=True)}
    SyncLauncher(partial(build_probed, str(marker)), world_size=2, timeout_s=120).train()
    seen = json.loads(marker.read_text())
    assert seen["launcher"] == os.getpid()
    sockets = {tuple(s) for s in seen["sockets"] if s[0] not in earlier} - before
    pids = {pid for pid, _, _ in sockets}
    assert os.getpid() in pids and len(pids) == 3, f"the store and each rank's gloo listen: {sockets}"
    assert all(ip in ("127.0.0.1", "::1") for _, ip, _ in sockets), sockets
