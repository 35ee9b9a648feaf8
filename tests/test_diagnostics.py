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


def test_a_smoothed_curve_is_a_line_over_its_faint_raw_points_and_a_second_axis_holds_more() -> None:
    from rlplex.diagnostics.plots import ema, learning_curves_figure

    assert ema([1.0, 1.0, 1.0], 0.6) == pytest.approx([1.0, 1.0, 1.0])  # debiased: no pull towards 0
    assert ema([0.0, 1.0], 0.5) == pytest.approx([0.0, 2 / 3]) and ema([3.0, 5.0], 0.0) == [3.0, 5.0]
    curves = {"a": ([0, 1, 2, 3], [0.1, 0.9, 0.2, 0.8]), "b": ([0, 1], [0.5, 0.6])}
    fig = learning_curves_figure(curves, title="t", smoothing=0.6, secondary={"acc": ([0, 3], [0.2, 0.4])},
                                 secondary_label="accuracy")  # fmt: skip
    left, right = fig.axes
    raw_a, smooth_a, raw_b, _smooth_b = left.get_lines()
    assert raw_a.get_alpha() == pytest.approx(0.3) and smooth_a.get_alpha() is None
    assert raw_a.get_color() == smooth_a.get_color() != raw_b.get_color()  # one colour per curve
    assert list(smooth_a.get_ydata()) == pytest.approx(ema([0.1, 0.9, 0.2, 0.8], 0.6))
    assert [line.get_label() for line in right.get_lines()] == ["acc"] and right.get_ylabel() == "accuracy"
    assert right.get_lines()[0].get_color() not in (raw_a.get_color(), raw_b.get_color())
    assert [t.get_text() for t in left.get_legend().get_texts()] == ["a", "b", "acc"]  # raw points unlabelled


def test_a_runs_report_plot_is_titled_with_its_settings_and_shows_its_evaluations(tmp_path: Path) -> None:
    from rlplex.diagnostics.plots import learning_curves_figure
    from rlplex.mainjob.config import RunEntry
    from rlplex.mainjob.report import run_figure_options, run_settings
    from rlplex.mainjob.view import RunView

    config = {"env": {"name": "reverse"}, "max_steps": 4, "batch_size": 4, "model": {"name": "m", "lora": {"rank": 4}},
              "optim": {"lr": 5e-3}}  # fmt: skip
    assert run_settings(RunEntry(id="run_a", config=config)) == "lr 0.005, LoRA rank 4, env reverse"
    # A run whose config is refused is titled with what it asked for, as far as it reads.
    bad = RunEntry(id="run_b", config={"env": {"name": "x"}, "optim": {"lr": "fast"}})
    assert run_settings(bad) == "lr fast, LoRA rank ?, env x"
    run = RunView("run_a", "finished", 4, 4, curve=[(0, 0.2), (1, 0.5), (2, 0.4), (3, 0.7)])
    run.evaluations = [
        {"step": 0, "eval/accuracy_t0": 0.1, "eval/accuracy_t1": 0.05},
        {"step": 4, "eval/accuracy_t0": 0.3},
    ]
    options = run_figure_options(run, run_settings(RunEntry(id="run_a", config=config)))
    fig = learning_curves_figure({"reward": ([0, 1, 2, 3], [0.2, 0.5, 0.4, 0.7])}, **options)
    left, right = fig.axes
    assert left.get_title() == "run_a: lr 0.005, LoRA rank 4, env reverse" and len(left.get_lines()) == 2
    held_out = {line.get_label(): list(line.get_xdata()) for line in right.get_lines()}
    assert held_out == {"held-out accuracy (greedy)": [0, 4], "held-out accuracy (t1)": [0]}
    path = plot_learning_curves({"reward": ([0, 1, 2, 3], [0.2, 0.5, 0.4, 0.7])}, tmp_path / "a.png", **options)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_plain_progress_line_says_how_far_how_long_and_the_eta() -> None:
    from rlplex.diagnostics.progress import ProgressLine

    line = ProgressLine(1000, "train", enabled=True, initial=200)
    line._started = 100.0  # as if it started 30 s before `now` below
    # 200 done before (a resume), 300 more in 30 s: 500 left at 10/s is 50 s.
    assert line.plain_line(500, "return=3", now=130.0) == "[train] 500/1,000 (50%) elapsed 0:30 ETA 0:50  return=3"
    assert line.plain_line(200, "", now=130.0) == "[train] 200/1,000 (20%) elapsed 0:30 ETA ?"
    line.close()
