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
