from __future__ import annotations

from pathlib import Path

import pytest

from rlplex.diagnostics import MetricsLogger, plot_learning_curves
from rlplex.diagnostics.metrics import read_metrics_csv
from rlplex.errors import RlplexError


def test_metrics_csv_widens_and_tensorboard_written(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path) as logger:
        logger.log(10, {"charts/return_mean": 1.0})
        logger.log(20, {"charts/return_mean": 2.0, "losses/policy": 0.5})
    rows = read_metrics_csv(tmp_path / "progress.csv")
    assert [r["step"] for r in rows] == [10, 20]
    assert rows[1]["losses/policy"] == 0.5 and "losses/policy" not in rows[0]
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


def test_metrics_resume_appends(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"charts/x": 1.0})
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(2, {"charts/x": 2.0})
    assert [r["charts/x"] for r in read_metrics_csv(tmp_path / "progress.csv")] == [1.0, 2.0]


def test_unnamespaced_key_refused(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, tensorboard=False) as logger, pytest.raises(RlplexError, match="namespaced"):
        logger.log(1, {"return": 1.0})


def test_plot_writes_png(tmp_path: Path) -> None:
    path = plot_learning_curves({"a": ([0, 1, 2], [0.0, 1.0, 4.0])}, tmp_path / "c.png", hline=3.0)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_styles_set_a_curve_colour(tmp_path: Path) -> None:
    import matplotlib.image

    curves = {"a": ([0, 1, 2], [0.0, 1.0, 4.0])}
    red = plot_learning_curves(curves, tmp_path / "red.png", styles={"a": {"color": "#ff0000", "linewidth": 3}})
    plain = plot_learning_curves(curves, tmp_path / "plain.png")

    def has_pure_red(path: Path) -> bool:
        rgb = matplotlib.image.imread(path)[..., :3]
        return bool(((rgb[..., 0] > 0.95) & (rgb[..., 1] < 0.05) & (rgb[..., 2] < 0.05)).any())

    assert has_pure_red(red) and not has_pure_red(plain)


def test_a_one_point_curve_is_drawn(tmp_path: Path) -> None:
    import matplotlib.image

    def red_pixels(curves: dict[str, tuple[list[float], list[float]]], name: str) -> int:
        path = plot_learning_curves(curves, tmp_path / name, styles={"a": {"color": "#ff0000"}})
        rgb = matplotlib.image.imread(path)[..., :3]
        return int(((rgb[..., 0] > 0.9) & (rgb[..., 1] < 0.2) & (rgb[..., 2] < 0.2)).sum())

    # The legend draws the same sample either way; only a visible point adds red pixels.
    assert red_pixels({"a": ([1000.0], [20.0])}, "one.png") > red_pixels({"a": ([], [])}, "none.png") + 10
