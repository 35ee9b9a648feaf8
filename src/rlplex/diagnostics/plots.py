"""Learning curves to PNG (matplotlib, headless).

One step's reward is a noisy sample, so a curve can be drawn smoothed (`smoothing`: the
weight of TensorBoard's debiased exponential moving average) as a solid line over its raw
points, drawn faint in the same colour: the trend is read from the line, the spread from the
points. A second set of curves (held-out accuracy beside the training reward, say) goes on a
right-hand axis of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Curve = tuple[Sequence[float], Sequence[float]]


SPARSE_POINTS = 20  # curves with at most this many points also mark each point
RAW_ALPHA = 0.3  # the raw points under a smoothed line


def ema(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average debiased at the start, so that
    the first points are not pulled towards zero. `weight` 0 returns the values unchanged."""
    smoothed, average = [], 0.0
    for n, value in enumerate(values, start=1):
        average = weight * average + (1 - weight) * value
        smoothed.append(average / (1 - weight**n) if weight < 1 else value)
    return smoothed


def learning_curves_figure(
    curves: Mapping[str, Curve],
    title: str = "",
    xlabel: str = "env steps",
    ylabel: str = "return",
    hline: float | None = None,
    styles: Mapping[str, Mapping[str, Any]] | None = None,
    smoothing: float | None = None,
    secondary: Mapping[str, Curve] | None = None,
    secondary_label: str = "",
) -> Figure:
    """The figure of named (x, y) curves on one axis (and `secondary` on a right-hand one).

    `styles` maps a label to extra `Axes.plot` keywords (colour, linestyle, ...), so that related
    curves can share a colour and differ in line style. `smoothing`: draw each curve as its
    moving average (`ema`) over its raw points."""
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
        if smoothing is None:
            ax.plot(xs, ys, label=label, **style)
            continue
        (raw,) = ax.plot(xs, ys, **{**style, "alpha": RAW_ALPHA, "linewidth": 0.8, "marker": "o", "markersize": 2.5})
        smooth_style = {k: v for k, v in style.items() if k not in ("marker", "markersize")}
        ax.plot(xs, ema(ys, smoothing), label=label, **{**smooth_style, "color": raw.get_color(), "linewidth": 1.8})
    if hline is not None:
        ax.axhline(hline, color="grey", linestyle="--", linewidth=1, label=f"target {hline:g}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if secondary:
        right = ax.twinx()
        for n, (label, (xs, ys)) in enumerate(secondary.items()):
            # Colours after the left axis's: a twin axis would start its own cycle at the first one.
            style = {"marker": "s", "markersize": 4, "linestyle": "--", "linewidth": 1.2}
            style["color"] = f"C{len(curves) + n}"
            right.plot(list(xs), list(ys), label=label, **{**style, **(styles or {}).get(label, {})})
        right.set_ylabel(secondary_label)
        more_handles, more_labels = right.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    if handles:
        ax.legend(handles, labels, loc="best", fontsize=8)
    fig.tight_layout()
    return fig


def plot_learning_curves(curves: Mapping[str, Curve], path: str | Path, **options: Any) -> Path:
    """`learning_curves_figure(curves, **options)` written as a PNG; returns the path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = learning_curves_figure(curves, **options)  # selects the headless backend first
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path
