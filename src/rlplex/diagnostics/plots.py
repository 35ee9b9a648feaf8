"""Learning curves to PNG (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

Curve = tuple[Sequence[float], Sequence[float]]


SPARSE_POINTS = 20  # curves with at most this many points also mark each point


def plot_learning_curves(
    curves: Mapping[str, Curve],
    path: str | Path,
    title: str = "",
    xlabel: str = "env steps",
    ylabel: str = "return",
    hline: float | None = None,
    styles: Mapping[str, Mapping[str, Any]] | None = None,
) -> Path:
    """Plot named (x, y) curves on one axis and write a PNG; returns the path written.

    `styles` maps a label to extra `Axes.plot` keywords (colour, linestyle, ...), so that
    related curves can share a colour and differ in line style."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Imported here: every process that logs metrics imports this package, few of them plot.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, (xs, ys) in curves.items():
        xs, ys = list(xs), list(ys)
        # A line needs two points: a short run's one-row curve would be invisible without markers.
        markers = {"marker": "o", "markersize": 3.5} if len(xs) <= SPARSE_POINTS else {}
        style = {"linewidth": 1.4, **markers, **(styles or {}).get(label, {})}
        ax.plot(xs, ys, label=label, **style)
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--", linewidth=1, label=f"target {hline:g}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
