"""Model interfaces for process-worker tests (importable by spawned children)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from rlplex.dataflow import MFCDef, ModelInterfaceType, build_graph

# The generate -> reward -> train graph the process and job-worker tests run.
GEN, INF, TRAIN = ModelInterfaceType.GENERATE, ModelInterfaceType.INFERENCE, ModelInterfaceType.TRAIN_STEP
GRAPH = build_graph(
    [
        MFCDef("gen", "generator", GEN, ("prompt",), ("seq",), 4),
        MFCDef("rew", "reward", INF, ("seq",), ("reward",), 4),
        MFCDef("train", "trainer", TRAIN, ("seq", "reward"), (), 8),
    ],
    dataset_keys=("prompt",),
)


class Generator:
    """Generates arange sequences; with `block_first_call_in`, the first call of the first
    process writes its pid there and blocks, so a test can kill it mid-call."""

    def __init__(self, block_first_call_in: str | None = None) -> None:
        self.block = Path(block_first_call_in) if block_first_call_in else None

    def generate(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if self.block is not None and self._claim_block(self.block):
            threading.Event().wait(120)  # killed long before this returns
        return {"seq": [np.arange(int(p) % 5 + 1, dtype=np.int64) + int(p) for p in inputs["prompt"]]}

    @staticmethod
    def _claim_block(marker: Path) -> bool:
        # Exclusive create: two generators starting their first calls together must not both
        # block, or the one the test does not kill stalls the step until its timeout.
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as file:
            file.write(str(os.getpid()))
        return True


class Reward:
    def inference(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        return {"reward": [np.float32(seq.sum()) for seq in inputs["seq"]]}


class Trainer:
    """Appends what it trained on to a file, so the test sees every datapoint exactly once."""

    def __init__(self, log: str) -> None:
        self.log = Path(log)

    def train_step(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        with self.log.open("a") as handle:
            for seq, reward in zip(inputs["seq"], inputs["reward"], strict=True):
                assert float(reward) == float(seq.sum())
                handle.write(f"{int(seq[0])}\n")
        return {}
