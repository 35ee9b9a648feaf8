"""AsyncRl with real processes: a tiny run, the replay-ratio throttle, a SIGKILLed child."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from node_helpers import launched_processes
from rlplex.agents import DqnAgent
from rlplex.algos import DQN, DQNConfig
from rlplex.config import validate_config
from rlplex.envs import EnvConfig
from rlplex.errors import ConfigError, WorkerDiedError
from rlplex.io.snapshot import latest_snapshot, read_snapshot
from rlplex.runners.async_ import AsyncRl, AsyncRlEval
from rlplex.runners.config import TrainConfig, build_runner
from rlplex.samplers import Evaluator
from timing import scaled

CARTPOLE = EnvConfig(id="CartPole-v1")


class Watched(AsyncRl):
    """Records, once training is under way, the /dev/shm names and processes it created."""

    started: threading.Event
    names: list[str]
    pids: list[int]
    before: set[str]

    def evaluate_performance(self) -> dict[str, float]:
        if not self.started.is_set():
            self.names = [*self.sampler.shared_names(), *self.replay_names()]
            self.pids = [p.pid for p in self.sampler.processes if p.pid is not None]
            self.started.set()
        return super().evaluate_performance()

    def replay_names(self) -> list[str]:
        replay = self.algo.replay
        return [name for _, name, _, _ in replay.handle.arrays.arrays] + ["sem." + replay._lock._semlock.name[1:]]


class WatchedEval(Watched, AsyncRlEval):
    pass


def owned_segments() -> set[str]:
    """The /dev/shm segments this process created (others' runs may share /dev/shm meanwhile)."""
    return {path.name for path in Path("/dev/shm").glob(f"rlplex-shm-{os.getpid()}-*")}


def watch(run: Watched) -> Watched:
    run.started, run.names, run.pids, run.before = threading.Event(), [], [], owned_segments()
    return run


def assert_cleaned_up(run: Watched) -> None:
    assert run.names and run.pids, "the run never reached its first log row"
    # The replay's lock is a named semaphore, unlinked when its last reference goes; a reference
    # cycle (a traceback's frames after a worker died) holds it until the collector runs.
    gc.collect()
    assert [n for n in run.names if os.path.exists(f"/dev/shm/{n}")] == [], "shared memory left behind"
    segments = [n for n in run.names if not n.startswith("sem.")]
    assert segments and all(n.startswith(f"rlplex-shm-{os.getpid()}-") for n in segments)
    assert owned_segments() - run.before == set(), "a segment of this run was left behind"
    assert not [p for p in mp.active_children() if p.is_alive()], "child processes left behind"
    for pid in run.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def runner(
    replay_ratio: float,
    n_steps: int,
    hidden: tuple[int, ...] = (16,),
    batch_size: int = 16,
    batch_B: int = 2,
    **kwargs: Any,
) -> Watched:
    config = DQNConfig(batch_size=batch_size, learning_starts=0, buffer_size=50_000, updates_per_itr=1)
    return watch(
        Watched(
            DQN(config, seed=0),
            partial(DqnAgent, hidden=hidden),
            CARTPOLE,
            batch_T=64,
            batch_B=batch_B,
            n_steps=n_steps,
            replay_ratio=replay_ratio,
            seed=0,
            show_progress=False,
            **kwargs,
        )
    )


@pytest.mark.slow
def test_async_eval_runs_a_tiny_budget_and_snapshots_the_replay(tmp_path: Path) -> None:
    config = DQNConfig(batch_size=16, learning_starts=0, buffer_size=4096)
    run = watch(
        WatchedEval(
            DQN(config, seed=0),
            partial(DqnAgent, hidden=(16,)),
            CARTPOLE,
            batch_T=32,
            batch_B=2,
            n_steps=2048,
            replay_ratio=2.0,
            seed=0,
            log_interval_steps=512,
            log_dir=tmp_path,
            show_progress=False,
            evaluator=Evaluator(CARTPOLE, n_episodes=2, seed=0),
        )
    )
    result = run.train()
    assert_cleaned_up(run)
    assert result.env_steps == 2048
    last = result.history[-1]
    for key in ("charts/replay_ratio", "charts/replay_ratio_cumulative", "charts/optimizer_busy_fraction",
                "charts/env_steps_per_s", "charts/updates_per_s", "charts/eval_return_mean"):  # fmt: skip
        assert key in last, key
    # Losses appear in the intervals that had updates; which ones depends on the two processes' pace.
    assert any("losses/td" in row for row in result.history), result.history
    assert last["charts/replay_ratio_cumulative"] <= 2.0 + 1e-9
    assert sum(row["charts/episodes"] for row in result.history) > 20  # CartPole episodes of ~20 steps
    snap = read_snapshot(latest_snapshot(tmp_path / "snapshots"))
    assert int(snap["algo"]["replay"]["counters"][1]) == len(snap["algo"]["replay"]["data"]["reward"]) > 0
    assert (tmp_path / "progress.csv").exists()
    # The two copiers take turns: each environment's steps sit in the replay in order, 2 slots
    # (batch_B) apart, across batch boundaries too (n-step returns and frame stacks rely on it).
    data = snap["algo"]["replay"]["data"]
    order = np.argsort(data["serial"])
    obs, next_obs, done = data["observation"][order], data["next_observation"][order], data["done"][order]
    follows = ~done[:-2]
    assert follows.sum() > 1000 and np.array_equal(obs[2:][follows], next_obs[:-2][follows])


@pytest.mark.slow
def test_throttle_reaches_the_set_point_when_the_optimizer_is_fast() -> None:
    # One env per policy call keeps the sampler at a few thousand steps/s, and batch 64 at
    # ratio 1 asks for one update per 64 steps: well within this optimizer's reach.
    run = runner(replay_ratio=1.0, n_steps=16_384, batch_size=64, batch_B=1, log_interval_steps=4096)
    result = run.train()
    assert_cleaned_up(run)
    final = result.history[-1]
    assert result.env_steps == 16_384
    assert 0.95 <= final["charts/replay_ratio_cumulative"] <= 1.0 + 1e-9, final
    assert all(row["charts/replay_ratio_cumulative"] <= 1.0 + 1e-9 for row in result.history)


@pytest.mark.slow
def test_a_slow_optimizer_gets_a_lower_ratio_and_both_sides_keep_running() -> None:
    # 512x512 network, batch 512, set point 64: far more than this optimizer can do.
    run = runner(replay_ratio=64.0, n_steps=8192, hidden=(512, 512), batch_size=512, log_interval_steps=2048)
    result = run.train()
    assert_cleaned_up(run)
    final = result.history[-1]
    assert result.env_steps == 8192  # the sampler ran to the end without waiting for the optimizer
    assert final["charts/updates"] > 0
    assert final["charts/replay_ratio_cumulative"] < 0.5 * 64.0
    assert final["charts/optimizer_busy_fraction"] > 0.8


@pytest.mark.slow
def test_a_floor_makes_the_sampler_wait_for_a_slow_optimizer() -> None:
    """`min_replay_ratio` bounds the run from the other side (Sample Factory's policy lag): with
    the same slow optimizer, the sampler waits, and the achieved ratio stays at the floor (less
    the two batches the double buffer holds and one update's worth of steps) in every interval, not
    only on average."""
    floor, batch_size, batch_steps = 4.0, 512, 64 * 2
    run = runner(replay_ratio=64.0, n_steps=4096, hidden=(512, 512), batch_size=batch_size, log_interval_steps=1024,
                 min_replay_ratio=floor)  # fmt: skip
    result = run.train()
    assert_cleaned_up(run)
    assert result.env_steps == 4096
    for row in result.history:
        steps = row["charts/env_steps"]
        lower = floor * (steps - 2 * batch_steps - batch_size / floor) / steps  # and one update's worth
        assert row["charts/replay_ratio_cumulative"] >= lower, (row, lower)
    with pytest.raises(ConfigError, match=r"field 'runner.min_replay_ratio': must be positive and at most"):
        runner(replay_ratio=2.0, n_steps=64, min_replay_ratio=4.0)


@pytest.mark.slow
def test_a_floor_equal_to_the_ceiling_never_stalls() -> None:
    """With min_replay_ratio = replay_ratio the bounds meet: the optimizer may do no update before
    new steps are copied, and the sampler may start no batch before more updates. An update of 24
    steps at ratio 2 covers 12 env steps, which do not divide a 128-step batch: the floor must
    leave the sampler the rest of an update's worth, or both wait for ever."""
    run = runner(replay_ratio=2.0, n_steps=2048, batch_size=24, log_interval_steps=512, min_replay_ratio=2.0)
    outcome: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: outcome.update(result=run.train()), daemon=True)
    thread.start()
    thread.join(timeout=120)
    if thread.is_alive():
        run.sampler.sync.stop.set()
        thread.join(timeout=30)
        raise AssertionError("AsyncRl stalled with min_replay_ratio = replay_ratio")
    result = outcome["result"]
    assert result.env_steps == 2048
    for row in result.history:
        steps = row["charts/env_steps"]
        # The floor's bound (AsyncRl._limit_sampling): the two batches the double buffer holds, and
        # the one update's worth of steps (24 / 2) the sampler may run ahead of the updates done.
        assert row["charts/replay_ratio_cumulative"] >= 2.0 * (steps - 2 * 128 - 24 / 2) / steps, row


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])  # the sampler process, then a copier
def test_sigkill_of_a_child_raises_worker_died_promptly(victim: int) -> None:
    run = runner(replay_ratio=1.0, n_steps=10_000_000, log_interval_steps=512)
    outcome: dict[str, Any] = {}

    def train() -> None:
        try:
            outcome["result"] = run.train()
        except BaseException as error:
            outcome["error"] = error
            outcome["at"] = time.monotonic()

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    try:
        assert run.started.wait(timeout=scaled(120)), "AsyncRl did not start"
        process = run.sampler.processes[victim]
        name = process.name
        killed_at = time.monotonic()
        os.kill(run.pids[victim], signal.SIGKILL)
        thread.join(timeout=30)
        assert not thread.is_alive(), "AsyncRl did not stop after its child was killed"
    finally:
        if thread.is_alive():
            run.sampler.sync.stop.set()
            thread.join(timeout=30)
    error = outcome.get("error")
    assert isinstance(error, WorkerDiedError), outcome
    assert name in str(error) and "-9" in str(error)
    # detection takes at most one poll (0.2 s); the rest is the orderly shutdown of the others
    assert outcome["at"] - killed_at < 2.5
    assert_cleaned_up(run)


def test_config_builds_async_runners() -> None:
    data = {
        "env": {"id": "CartPole-v1"},
        "algo": {"name": "dqn"},
        "sampler": {"batch_T": 16, "batch_B": 2},
        "runner": {"kind": "async_eval", "replay_ratio": 4.0, "n_steps": 1000},
    }
    built = build_runner(validate_config(TrainConfig, data), output_dir=None, show_progress=False)
    assert isinstance(built, AsyncRlEval) and built.replay_ratio == 4.0 and built.itr_batch_size == 32


@pytest.mark.slow
def test_resume_continues_counters_epsilon_and_replay(tmp_path: Path) -> None:
    def make(n_steps: int) -> Watched:
        config = DQNConfig(batch_size=16, learning_starts=0, buffer_size=8192, exploration_fraction=0.9)
        return watch(
            Watched(
                DQN(config, seed=0),
                partial(DqnAgent, hidden=(16,)),
                CARTPOLE,
                batch_T=32,
                batch_B=2,
                n_steps=n_steps,
                replay_ratio=1.0,
                seed=0,
                log_interval_steps=512,
                log_dir=tmp_path,
                snapshot_mode="all",
                show_progress=False,
            )
        )

    make(1024).train()
    snap_dir = latest_snapshot(tmp_path / "snapshots")
    saved = read_snapshot(snap_dir)
    assert int(saved["env_steps"]) == 1024
    resumed = make(2048)
    resumed.resume_from(snap_dir)
    result = resumed.train()
    assert_cleaned_up(resumed)
    assert result.env_steps == 2048
    final = read_snapshot(latest_snapshot(tmp_path / "snapshots"))
    assert int(final["algo"]["replay"]["counters"][2]) == 2048  # 1024 restored + 1024 new
    assert int(final["algo"]["update_count"]) > int(saved["algo"]["update_count"]) > 0
    # Each snapshot holds the epsilon of its own iteration, whatever the optimizer's lag; the
    # resumed run's schedule went on from iteration 16 (a restart at 0 would end it at ~0.47).
    eps_final = DQNConfig().eps_final
    assert float(saved["agent"]["epsilon"]) == pytest.approx(eps_final)
    assert float(final["agent"]["epsilon"]) == pytest.approx(eps_final)


def child_pids(pid: int, n: int, timeout: float = 60.0) -> list[int]:
    """The first `n` processes `pid` started, waiting until that many exist."""
    deadline = time.monotonic() + scaled(timeout)
    children: list[int] = []
    while time.monotonic() < deadline:
        children = sorted(child.pid for child in launched_processes(psutil.Process(pid)))
        if len(children) >= n:
            return children[:n]
        time.sleep(0.05)  # polling for a condition, with a deadline
    raise AssertionError(f"process {pid} has {len(children)} children, expected {n}")


@pytest.mark.slow
def test_parallel_async_sampler_sigkilled_worker_fails_fast_and_leaves_nothing() -> None:
    run = runner(replay_ratio=1.0, n_steps=10_000_000, batch_B=4, log_interval_steps=512, n_workers=2)
    outcome: dict[str, Any] = {}

    def train() -> None:
        try:
            outcome["result"] = run.train()
        except BaseException as error:
            outcome["error"] = error
            outcome["at"] = time.monotonic()

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    try:
        # Three processes import torch before the first row: on a loaded machine, minutes.
        assert run.started.wait(timeout=scaled(300)), "AsyncRl did not start"
        sampler_pid = run.pids[0]
        workers = child_pids(sampler_pid, 2)
        killed_at = time.monotonic()
        os.kill(workers[1], signal.SIGKILL)
        thread.join(timeout=30)
        assert not thread.is_alive(), "AsyncRl did not stop after a sampler worker was killed"
    finally:
        if thread.is_alive():
            run.sampler.sync.stop.set()
            thread.join(timeout=30)
    error = outcome.get("error")
    assert isinstance(error, WorkerDiedError), outcome
    # The master names its child and, from the child's report, the worker that died.
    assert "async-sampler" in str(error) and "sampler worker 1" in str(error) and "-9" in str(error), error
    assert outcome["at"] - killed_at < 5.0
    assert_cleaned_up(run)
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # The sampler process unlinked the segments it created for its workers before it exited.
    assert list(Path("/dev/shm").glob(f"rlplex-shm-{sampler_pid}-*")) == []


@pytest.mark.slow
def test_toml_parallel_sampler_under_async_trains_sac(tmp_path: Path) -> None:
    data = {
        "env": {"id": "Pendulum-v1"},
        "algo": {"name": "sac", "batch_size": 64, "learning_starts": 256, "critic_hidden": [32, 32]},
        "agent": {"hidden": [32, 32]},
        "sampler": {"kind": "parallel", "n_workers": 2, "batch_T": 32, "batch_B": 4},
        "runner": {"kind": "async", "replay_ratio": 2.0, "n_steps": 2048, "log_interval_steps": 512},
    }
    built = build_runner(validate_config(TrainConfig, data), output_dir=tmp_path, show_progress=False)
    assert isinstance(built, AsyncRl) and built.n_workers == 2
    result = built.train()
    assert result.env_steps == 2048
    assert any("losses/critic" in row for row in result.history), result.history[-1]
    # 4 environments of 512 steps each, 200-step Pendulum episodes: 2 complete episodes each.
    assert sum(row["charts/episodes"] for row in result.history) == 8
    assert not [p for p in mp.active_children() if p.is_alive()]
