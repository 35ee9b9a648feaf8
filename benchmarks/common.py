"""Helpers shared by the benchmarks: config overrides, timed evaluation, output folder."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from rlplex.config import validate_config
from rlplex.runners.config import TrainConfig
from rlplex.samplers import Evaluator

RESULTS = Path("bench_results")


def override(config: TrainConfig, section: str, **updates: Any) -> TrainConfig:
    """A copy of `config` with fields of one section replaced (validated like the TOML file)."""
    data = config.model_dump()
    data[section].update(updates)
    return validate_config(TrainConfig, data, source=f"benchmark override of [{section}]")


class TimedEvaluator(Evaluator):
    """An `Evaluator` that adds up the seconds it spends, so they can be excluded from timings."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seconds = 0.0

    def evaluate(self, agent: Any) -> tuple[np.ndarray, np.ndarray]:
        t0 = time.perf_counter()
        try:
            return super().evaluate(agent)
        finally:
            self.seconds += time.perf_counter() - t0


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path
