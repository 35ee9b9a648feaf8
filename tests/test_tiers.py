"""The suite's tiers and worker groups do what tests/conftest.py says: a test that starts a job,
a vLLM server or Ray is `e2e` (so `make test-fast` leaves it out), and an xdist group reaches
pytest-xdist's scheduler (a pytest that stopped reading xdist's group suffix once spread every
group over all workers, and each worker started a vLLM server of its own)."""

from __future__ import annotations

import inspect

import pytest

# Calls that start a job, a server or Ray, as tests spell them.
STARTS = ("PrimeMaster.create(", "PrimeMaster.resume(", "run_main_job(", "local_ray(", "vllm_server(", "ray.init(")


@pytest.mark.xdist_group("tiers")
def test_every_xdist_group_reaches_the_scheduler(request: pytest.FixtureRequest) -> None:
    """tests/conftest.py adds most groups in its collection hook: they count only if they are there
    before pytest-xdist's own hook reads them (and suffixes the node id with the group)."""
    if not request.config.getvalue("loadgroup"):
        pytest.skip("runs under `--dist loadgroup` (make test)")
    assert request.node.nodeid.endswith("@tiers"), request.node.nodeid
    grouped = [item for item in request.session.items if item.get_closest_marker("xdist_group") is not None]
    lost = [item.nodeid for item in grouped if "@" not in item.nodeid]
    assert len(grouped) > 1 and lost == [], lost[:5]


def test_every_test_that_starts_a_job_a_server_or_ray_is_e2e(request: pytest.FixtureRequest) -> None:
    items = [item for item in request.session.items if isinstance(item, pytest.Function)]
    if len(items) < 100:
        pytest.skip("checks the whole suite's collection")
    unmarked = []
    for item in items:
        try:
            source = inspect.getsource(item.function)
        except (OSError, TypeError):
            continue
        if any(call in source for call in STARTS) and item.get_closest_marker("e2e") is None:
            unmarked.append(item.nodeid)
    assert unmarked == [], "mark these e2e (pytest.mark.e2e, or a fixture in E2E_FIXTURES)"
