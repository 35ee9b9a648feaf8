"""Diagnostics rows shared by every runner, so that all runners log the same keys."""

from __future__ import annotations

import time

import numpy as np

from rlplex.agents.base import Agent
from rlplex.samplers.base import Evaluator


def episode_metrics(returns: np.ndarray, lengths: np.ndarray) -> dict[str, float]:
    """Statistics of the training episodes completed in a log interval."""
    row = {"charts/episodes": float(len(returns))}
    if len(returns):
        row["charts/online_return_mean"] = float(np.mean(returns))
        row["charts/online_return_std"] = float(np.std(returns))
        row["charts/online_length_mean"] = float(np.mean(lengths))
    return row


def evaluation_metrics(evaluator: Evaluator, agent: Agent) -> dict[str, float]:
    """Run the evaluator's deterministic episodes and summarise them."""
    t0 = time.perf_counter()
    returns, lengths = evaluator.evaluate(agent)
    return {
        "charts/eval_return_mean": float(np.mean(returns)),
        "charts/eval_return_min": float(np.min(returns)),
        "charts/eval_length_mean": float(np.mean(lengths)),
        "charts/eval_time_s": time.perf_counter() - t0,
    }
