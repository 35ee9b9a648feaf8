"""`--cpu-top=N`: the N tests that cost the most CPU, beside pytest's `--durations`.

A duration is wall time: a test that waits on its own processes looks expensive there, but
costs a 2-core suite only the CPU its processes burn, and that CPU is what makes the suite
long (the other worker fills any wait). Each test's figure is the pytest worker's own CPU
plus that of every descendant it has reaped (`getrusage` of self and children) from the start
of its set-up to the end of its teardown. Processes that outlive their parent and are reaped
by init (a job's nodes after their master died) are not counted, and a session fixture's
start-up (the shared vLLM server) is charged to the first test that asks for it.
"""

from __future__ import annotations

import resource
from collections.abc import Generator
from typing import Any

import pytest

KEY = "cpu_s"
_STARTED: dict[str, float] = {}
_COSTS: list[tuple[float, str]] = []


def cpu_seconds() -> float:
    """CPU time of this process and of its reaped descendants."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-top",
        type=int,
        default=0,
        metavar="N",
        help="list the N tests that used the most CPU (the worker's and its reaped children's)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _STARTED[item.nodeid] = cpu_seconds()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    if call.when == "teardown" and item.nodeid in _STARTED:
        # On the report, which pytest-xdist carries from its worker to the controller that prints.
        report.user_properties.append((KEY, cpu_seconds() - _STARTED.pop(item.nodeid)))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":
        for name, value in report.user_properties:
            if name == KEY:
                _COSTS.append((float(value), report.nodeid))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    top = int(config.getoption("cpu_top"))
    if top <= 0 or not _COSTS:
        return
    total = sum(cost for cost, _ in _COSTS)
    terminalreporter.write_sep("=", f"{top} most CPU-costly tests (all {len(_COSTS)}: {total:.0f} CPU-s)")
    for cost, nodeid in sorted(_COSTS, reverse=True)[:top]:
        terminalreporter.write_line(f"{cost:8.2f} CPU-s  {nodeid}")
