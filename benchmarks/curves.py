"""Learning-curve analysis for the learning benchmarks: a trailing moving average, a curve's
summary (first and final rewards, when the smoothed curve reached a target, its noise), and the
gap between two curves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def smooth(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing moving average (shorter at the start)."""
    x = np.asarray(values, dtype=float)
    sums = np.concatenate([[0.0], np.cumsum(x)])
    idx = np.arange(len(x))
    start = np.maximum(0, idx - window + 1)
    return (sums[idx + 1] - sums[start]) / (idx + 1 - start)


def curve_summary(rewards: Sequence[float], window: int, tail: int, target: float) -> dict[str, Any]:
    smoothed = smooth(rewards, window)
    reached = np.flatnonzero(smoothed >= target)
    # Step-to-step noise around a slowly moving trend: differences of neighbours cancel the trend.
    step_noise = float(np.std(np.diff(rewards)) / np.sqrt(2)) if len(rewards) > 2 else float("nan")
    first, final = float(np.mean(rewards[:tail])), float(np.mean(rewards[-tail:]))
    return {
        "first": first,
        "final": final,
        "rise": final - first,
        "final_reached_target": bool(np.mean(rewards[-tail:]) >= target),
        "smoothed_reached_target_at_step": int(reached[0]) if reached.size else None,
        "step_noise_std": step_noise,
        "smoothed_noise_std": step_noise / np.sqrt(window),
    }


def curve_gap(a: Sequence[float], b: Sequence[float], window: int) -> dict[str, float]:
    n = min(len(a), len(b))
    diff = np.abs(smooth(a[:n], window) - smooth(b[:n], window))
    return {
        "max_abs": float(diff.max()),
        "mean_abs": float(diff.mean()),
        "raw_identical_steps": int(np.sum(np.asarray(a[:n]) == np.asarray(b[:n]))),
    }
