"""`rlplex train` killed as a user would kill it: its ranks and sampler processes die with it.

Real `rlplex train` processes started with subprocess; the launcher is killed (SIGKILL or
SIGTERM) while it trains, and every child process must be gone within about 2 s, with no
snapshot written after the kill. Whatever is left is killed by pid at the end of each test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from node_helpers import launched_processes
from timing import scaled, wait_for

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="parent-death signals are Linux-only")

SYNC_TEMPLATE = """
[env]
id = "CartPole-v1"
[sampler]
batch_T = 16
batch_B = 2
[algo]
name = "ppo"
n_epochs = 1
[runner]
kind = "sync"
world_size = {world_size}
n_steps = 100_000_000
log_interval_steps = 64
"""

# One rank is enough where a test is about the launcher's own handling (cheaper to start).
SYNC, SYNC_ONE_RANK = SYNC_TEMPLATE.format(world_size=2), SYNC_TEMPLATE.format(world_size=1)

ASYNC = """
[env]
id = "CartPole-v1"
[sampler]
batch_T = 16
batch_B = 2
[algo]
name = "dqn"
buffer_size = 5_000
learning_starts = 64
updates_per_itr = 1
[runner]
kind = "async"
n_steps = 100_000_000
log_interval_steps = 64
"""

DEATH_S = 2.0  # the parent-death signal arrives at once; this bounds a loaded machine's delay


def _snapshot_files(out: Path) -> dict[str, float]:
    found = {}
    for path in (out / "snapshots").rglob("*"):
        try:
            found[str(path.relative_to(out))] = path.stat().st_mtime
        except FileNotFoundError:  # a "last" snapshot removed its predecessor meanwhile
            pass
    return found


class Training:
    """A real `rlplex train` in its own session, with the pids of everything it started."""

    def __init__(self, tmp_path: Path, config: str) -> None:
        (tmp_path / "c.toml").write_text(config)
        self.out = tmp_path / "out"
        self.log = (tmp_path / "train.log").open("w")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rlplex.cli",
                "train",
                str(tmp_path / "c.toml"),
                "--output",
                str(self.out),
                "--no-progress",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.launcher = psutil.Process(self.process.pid)
        self.seen: dict[int, psutil.Process] = {}

    def wait_training(self, n_workers: int) -> list[psutil.Process]:
        """Until `n_workers` children run and a snapshot exists: the run is in its loop."""

        def ready() -> bool:
            assert self.process.poll() is None, f"rlplex train exited early: {self.output()}"
            workers = launched_processes(self.launcher)
            self.seen.update({w.pid: w for w in workers})
            return len(workers) == n_workers and bool(list((self.out / "snapshots").glob("itr_*")))

        wait_for(ready, 120, f"{n_workers} children and a first snapshot")
        return launched_processes(self.launcher)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def cleanup(self) -> None:
        everything = list(self.seen.values())
        if self.process.poll() is None:
            everything += self.launcher.children(recursive=True)
        for proc in [self.launcher, *everything]:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        self.process.wait(timeout=scaled(10))
        psutil.wait_procs(everything, timeout=10)
        self.log.close()


@pytest.fixture
def training(tmp_path: Path) -> Iterator[Callable[[str], Training]]:
    started: list[Training] = []

    def start(config: str) -> Training:
        started.append(Training(tmp_path, config))
        return started[-1]

    yield start
    for run in started:
        run.cleanup()


def _running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever reaps it; it runs nothing)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_all_die(workers: list[psutil.Process], killed_at: float) -> None:
    deadline = killed_at + DEATH_S
    while (alive := [p.pid for p in workers if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive, f"children still running {DEATH_S} s after the launcher was killed: {alive}"


@pytest.mark.slow
@pytest.mark.parametrize("config, n_workers", [(SYNC, 2), (ASYNC, 3)], ids=["sync-ranks", "async-children"])
def test_sigkill_of_the_launcher_kills_every_child_and_stops_the_snapshots(
    training: Callable[[str], Training], config: str, n_workers: int
) -> None:
    run = training(config)
    workers = run.wait_training(n_workers)
    os.kill(run.process.pid, signal.SIGKILL)
    # From the launcher's death (on a loaded machine its exit can lag the kill): the children
    # are signalled as it exits.
    run.process.wait(timeout=scaled(10))
    dead_at, dead_wall = time.monotonic(), time.time()
    _assert_all_die(workers, dead_at)
    # Nothing writes any more; a snapshot stamped after the launcher died came from an orphan.
    late = {name: t for name, t in _snapshot_files(run.out).items() if t > dead_wall + 0.1}
    assert not late, f"snapshot files written after the launcher died: {sorted(late)}"


@pytest.mark.slow
def test_sigterm_stops_rlplex_train_like_ctrl_c(training: Callable[[str], Training]) -> None:
    run = training(SYNC_ONE_RANK)
    workers = run.wait_training(1)
    os.kill(run.process.pid, signal.SIGTERM)
    killed_at = time.monotonic()
    # The launcher stops its ranks itself, then exits with 128 + SIGTERM.
    assert run.process.wait(timeout=scaled(30)) == 128 + signal.SIGTERM, run.output()
    assert "stopped by SIGTERM" in run.output()
    _assert_all_die(workers, killed_at)


@pytest.mark.slow
def test_a_killed_rank_fails_the_run_with_exit_code_1(training: Callable[[str], Training]) -> None:
    run = training(SYNC_ONE_RANK)
    (rank,) = run.wait_training(1)
    rank.kill()
    assert run.process.wait(timeout=scaled(60)) == 1, run.output()
    assert "run failed" in run.output() and "died with exit code -9" in run.output()
