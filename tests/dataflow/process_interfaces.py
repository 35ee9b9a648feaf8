"""Model interfaces for process-worker tests (importable by spawned children)."""

from __future__ import annotations

import os
import threading
import time
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
    """Generates arange sequences; with `block_first_call_in`, call number `block_on_call`
    (the first by default) of the first process to reach it writes its pid there and blocks,
    so a test can kill it mid-call (after earlier calls left outputs in its store)."""

    def __init__(self, block_first_call_in: str | None = None, block_on_call: int = 1) -> None:
        self.block = Path(block_first_call_in) if block_first_call_in else None
        self.block_on_call, self.calls = block_on_call, 0

    def generate(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        self.calls += 1
        if self.block is not None and self.calls == self.block_on_call and self._claim_block(self.block):
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
    """With `hold_first_call_in`: the first call writes this process's pid there and waits until
    a file of the same name plus `.go` exists (the generators are idle meanwhile)."""

    def __init__(self, hold_first_call_in: str | None = None) -> None:
        self.hold = Path(hold_first_call_in) if hold_first_call_in else None

    def inference(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if self.hold is not None:
            hold, self.hold = self.hold, None
            hold.write_text(str(os.getpid()))
            release, deadline = hold.with_name(hold.name + ".go"), time.monotonic() + 120
            while not release.exists() and time.monotonic() < deadline:
                threading.Event().wait(0.02)
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


# Two MFCs of one model, ready at the same moment: both run on the same worker at once.
SHARED_GRAPH = build_graph(
    [
        MFCDef("gen", "shared", GEN, ("prompt",), ("seq",), 8),
        MFCDef("score", "shared", INF, ("prompt",), ("score",), 8),
        MFCDef("train", "trainer", TRAIN, ("seq", "score"), (), 8),
    ],
    dataset_keys=("prompt",),
)


class Shared:
    """Generate and score on one model; the work is sized so the two calls overlap."""

    def generate(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        work = np.random.default_rng(0).random((200, 200))
        for _ in range(20):
            work = work @ work / 200
        return {"seq": [np.arange(int(p) % 5 + 1, dtype=np.int64) + int(p) for p in inputs["prompt"]]}

    def inference(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        return {"score": [np.float32(sum(range(int(p), int(p) + int(p) % 5 + 1))) for p in inputs["prompt"]]}


class ScoreTrainer(Trainer):
    def train_step(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        return super().train_step(mfc, {"seq": inputs["seq"], "reward": inputs["score"]})
