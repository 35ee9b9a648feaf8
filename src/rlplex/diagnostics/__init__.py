"""Metrics, progress display and plots: what a user watches and reads while and after training."""

from rlplex.diagnostics.metrics import MetricsLogger
from rlplex.diagnostics.plots import plot_learning_curves
from rlplex.diagnostics.progress import ProgressLine

__all__ = ["MetricsLogger", "ProgressLine", "plot_learning_curves"]
