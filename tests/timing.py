"""One factor for every deadline the tests set: RLPLEX_TEST_TIME_SCALE.

A deadline in a test is either a wait for something that should happen (`wait_for`'s timeout, a
subprocess's, pytest-timeout's) or a health deadline the job under test must *not* miss (a
heartbeat or RPC timeout of a node that is meant to stay healthy). Both are written as the
seconds an idle 2-core machine needs, with room, and pass through `scaled()`. The default, 2,
is sized for a loaded 2-core machine (the suite's own two workers plus two busy loops beside
them); raise it on a slower or busier one. A deadline the test *wants* to expire (the hang it
provokes) stays unscaled, so that the test does not get slower.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from rlplex.errors import ConfigError


def _time_scale() -> float:
    raw = os.environ.get("RLPLEX_TEST_TIME_SCALE", "2")
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"environment variable RLPLEX_TEST_TIME_SCALE: {raw!r} is not a number") from None
    if not value > 0:
        raise ConfigError(f"environment variable RLPLEX_TEST_TIME_SCALE: {raw!r} must be more than 0")
    return value


TIME_SCALE = _time_scale()


def scaled(seconds: float) -> float:
    """`seconds` on an idle 2-core machine, stretched for this one."""
    return seconds * TIME_SCALE


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.02) -> object:
    """Poll `predicate` until it returns something truthy; fail the test naming `what` after
    `scaled(timeout)` seconds."""
    limit = scaled(timeout)
    deadline = time.monotonic() + limit
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit:g} s waiting for {what}")
        time.sleep(interval)
