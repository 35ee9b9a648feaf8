"""Issue 31, hole 2: every reward call runs in a child process under a hard deadline, so a call
that never returns (one holding the GIL included) scores 0 instead of freezing the scorer."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from reward_helpers import exit_on_boom, hold_the_gil, running
from rlplex.tasks import Example, safe_scores
from rlplex.tasks.reward_guard import RewardGuard, process_guard, reward_deadline
from rlplex.tasks.rewards import exact_match, math_answer
from timing import scaled, wait_for

TESTS = Path(__file__).resolve().parent
# 17 characters that make math-verify compute 9^387420489 holding the GIL (minutes, then more).
POWER_TOWER = r"\boxed{9^{9^{9}}}"


def test_a_power_tower_times_out_alone_and_the_batch_keeps_its_scores(caplog: pytest.LogCaptureFixture) -> None:
    deadline = scaled(1.0)  # the right rows must not reach it (the worker warms math-verify up first)
    completions = ["1", POWER_TOWER, "2", "The answer is $1$."]
    examples = [Example(prompt="What is 3 - 2?", answer="1")] * len(completions)
    with caplog.at_level(logging.WARNING, logger="rlplex.tasks"), reward_deadline(deadline) as tally:
        started = time.monotonic()
        scores = safe_scores(math_answer, examples, completions, "math")
        elapsed = time.monotonic() - started
    assert scores == [1.0, 0.0, 0.0, 1.0]
    # The late call, then a fresh worker for the rows after it (start, sympy's import again).
    assert elapsed < deadline + scaled(4), elapsed
    (record,) = caplog.records
    message = record.getMessage()
    assert "'math': reward failed on 1 of 4 samples" in message
    assert f"row 1: timed out after {deadline:g} s" in message
    assert (tally.rows, tally.timed_out, tally.reward) == (4, 1, "rlplex.tasks.rewards:math_answer")
    assert not tally.mostly_timed_out


def test_a_reward_holding_the_gil_leaves_the_callers_threads_running() -> None:
    examples = [Example(prompt="p", answer="a")]
    assert safe_scores(exact_match, examples, ["a"], "warm") == [1.0]  # the worker is up
    worker = process_guard().pid
    assert worker is not None
    ticks: list[float] = []
    stop = threading.Event()

    def heartbeat() -> None:
        while not stop.wait(0.01):
            ticks.append(time.monotonic())

    thread = threading.Thread(target=heartbeat)
    thread.start()
    try:
        with reward_deadline(1.5) as tally:
            started = time.monotonic()
            scores = safe_scores(hold_the_gil, examples, ["a"], "gil")
            ended = time.monotonic()
    finally:
        stop.set()
        thread.join(timeout=scaled(5))
    assert scores == [0.0] and tally.timed_out == 1 and tally.mostly_timed_out
    assert ended - started >= 1.5
    beats = [started, *(t for t in ticks if started < t < ended), ended]
    # In process, the first call would have stopped the heartbeat for minutes.
    assert max(b - a for a, b in itertools.pairwise(beats)) < scaled(0.25)
    assert not running(worker), "the late worker is killed and reaped"
    assert safe_scores(exact_match, examples, ["a"], "after") == [1.0]  # a new worker, started on demand


def test_a_worker_that_dies_gets_one_more_try_then_the_row_scores_zero(caplog: pytest.LogCaptureFixture) -> None:
    examples = [Example(prompt="p", answer="a")] * 3
    with caplog.at_level(logging.WARNING, logger="rlplex.tasks"):
        assert safe_scores(exit_on_boom, examples, ["a", "boom", "a"], "exits") == [1.0, 0.0, 1.0]
    (record,) = caplog.records
    assert "row 1: ended the reward worker process (exit code 3)" in record.getMessage()


def test_a_reward_that_cannot_be_pickled_runs_in_process_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    examples = [Example(prompt="p", answer="a")] * 2
    with caplog.at_level(logging.WARNING, logger="rlplex.tasks"):
        for _ in range(2):
            assert safe_scores(lambda p, c, a: float(c == a), examples, ["a", "b"], "closure") == [1.0, 0.0]
    (record,) = caplog.records
    assert "runs in this process, without a deadline" in record.getMessage()
    assert "cannot be pickled" in record.getMessage()


def test_the_worker_ends_when_the_guard_closes() -> None:
    guard = RewardGuard()
    assert guard.outcomes(exact_match, [("p", "a", "a"), ("p", "b", "a")], 5.0) == [1.0, 0.0]
    pid = guard.pid
    assert pid is not None and running(pid)
    guard.close()
    assert guard.pid is None and not running(pid)


_PARENT = """
import sys, threading, time
from rlplex.tasks.reward_guard import RewardGuard
from reward_helpers import touch_then_hold_the_gil

guard = RewardGuard()
call = (touch_then_hold_the_gil, [("p", sys.argv[1], "a")], 600.0)
threading.Thread(target=guard.outcomes, args=call, daemon=True).start()
while guard.pid is None:
    time.sleep(0.01)
print(guard.pid, flush=True)
time.sleep(600)
"""


def test_a_busy_worker_ends_when_its_parent_is_killed(tmp_path: Path) -> None:
    # Busy in a call that holds the GIL, the worker never reads its pipe's end: the kernel ends it.
    marker = tmp_path / "call-started"
    path = os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)])
    env = {**os.environ, "PYTHONPATH": path}
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(marker)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert parent.stdout is not None
        worker = int(parent.stdout.readline())
        wait_for(marker.exists, 30, "the worker to begin the call")
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=scaled(10))
        wait_for(lambda: not running(worker), 10, "the worker to end with its parent")
    finally:
        parent.kill()
        parent.wait(timeout=scaled(10))
