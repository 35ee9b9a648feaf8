from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def _multirun_warnings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="rlplex.multirun")
