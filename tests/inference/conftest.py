from __future__ import annotations

from collections.abc import Iterator

import pytest
from vllm_helpers import Served, vllm_server

from lm_models import small_tiny_model


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One vLLM-CPU server for the session's client tests (it takes about 40 s to start)."""
    with vllm_server(small_tiny_model(), tmp_path_factory.mktemp("vllm")) as served:
        yield served
