"""The end-of-job report: `report.md` with each run's learning curve (PNG), how much its
reward rose, its wall time and time per step, throughput, evictions and restarts. (TensorBoard
and W&B are written while the job runs, by each run's trackers: `diagnostics/trackers.py`.)

Each curve is the reward smoothed over its raw points, against the run's own step (a run that
joined late starts at its step 0 like the others); a run's own plot is titled with what sets it
apart (learning rate, LoRA rank, environment) and shows its held-out accuracy when it has one."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from rlplex.diagnostics.plots import plot_learning_curves
from rlplex.errors import RlplexError
from rlplex.mainjob.config import RunEntry
from rlplex.mainjob.registry import read_registry
from rlplex.mainjob.timing import ETA_WINDOW_STEPS, format_duration
from rlplex.mainjob.view import REWARD_WINDOW, JobView, RunView, collect, open_job_store

REPORT_FILE = "report.md"


SMOOTHING = 0.6  # TensorBoard's default weight: the trend of a 12-step run still shows


def run_settings(entry: RunEntry) -> str:
    """What sets a run apart, for its plot's title: 'lr 0.005, LoRA rank 8, env reverse'."""
    try:
        orch = entry.orch_config("<report>")
    except RlplexError:  # a rejected run's config: what it asked for, as far as it can be read

        def table(data: dict[str, Any], key: str) -> dict[str, Any]:
            value = data.get(key)
            return value if isinstance(value, dict) else {}

        lr, env = table(entry.config, "optim").get("lr", "?"), table(entry.config, "env").get("name", "?")
        rank = table(table(entry.config, "model"), "lora").get("rank", "?")
        return f"lr {lr}, LoRA rank {rank}, env {env}"
    return f"lr {orch.optim.lr:g}, LoRA rank {orch.model.lora.rank}, env {orch.env.name}"


def run_figure_options(run: RunView, settings: str) -> dict[str, Any]:
    """The options of `learning_curves_figure` for one run's plot: its reward, smoothed, and its
    held-out accuracy per temperature on the right-hand axis."""
    secondary: dict[str, tuple[list[float], list[float]]] = {}
    for key in sorted({k for row in run.evaluations for k in row if k.startswith(ACCURACY_PREFIX)}):
        rows = sorted((row["step"], row[key]) for row in run.evaluations if key in row)
        temperature = float(key.removeprefix(ACCURACY_PREFIX))
        name = "greedy" if temperature == 0 else f"t{temperature:g}"
        secondary[f"held-out accuracy ({name})"] = ([x for x, _ in rows], [y for _, y in rows])
    return {
        "title": f"{run.run_id}: {settings}",
        "xlabel": "step (of this run)",
        "ylabel": "mean reward",
        "smoothing": SMOOTHING,
        "secondary": secondary,
        "secondary_label": "held-out accuracy",
    }


def _decisions(output_dir: Path) -> list[str]:
    if not (output_dir / "job.sqlite").exists():
        return []
    with open_job_store(output_dir) as job:
        return [] if job is None else [f"{d.old} {d.entity}: {d.cause}" for d in job.decisions()]


def write_report(output_dir: Path, fallback_wall_time_s: float) -> Path:
    """The wall time runs from the job's creation in the store (so a resumed master reports the
    whole job); `fallback_wall_time_s` serves when the store has no job."""
    view = collect(output_dir)
    wall_time_s = view.read_at - view.created_at if view.created_at else fallback_wall_time_s
    trainer_tokens_per_s = view.trained_tokens / wall_time_s if wall_time_s > 0 else None
    plots = output_dir / "plots"
    lines = [
        f"# Job report: {output_dir.name}",
        "",
        f"Job state: **{view.outcome}**" + (f" ({view.job_cause})" if view.outcome in ("FINISHED", "FAILED") else ""),
        f"Wall time: {wall_time_s:.1f} s; written {time.strftime('%Y-%m-%d %H:%M:%S')}",
    ]
    if trainer_tokens_per_s is not None:
        lines.append(
            f"Trainer throughput: {trainer_tokens_per_s:.0f} tokens/s (all runs' trained tokens over the wall time)"
        )
    header = ("run", "state", "steps", "reward at start", "reward at end", "rise", "rollout tokens/s", "wall",
              "s/step", "note")  # fmt: skip
    lines += ["", f"Start and end rewards are means over the first and the newest {REWARD_WINDOW} steps; a run's wall"
              " time runs from its folder being made to its end (or the job's); s/step is its median over its"
              f" newest {ETA_WINDOW_STEPS} steps."]  # fmt: skip
    lines += ["", "## Runs", "", _row(header), _row(("---",) * len(header))]
    for run in view.runs:
        steps = f"{run.trained_steps}/{run.max_steps}"
        wall, pace = format_duration(view.run_elapsed_s(run)), _num(run.seconds_per_step, ".2f")
        rewards = (_num(run.reward_start), _num(run.reward_end), _num(run.reward_rise, "+.3f"))
        lines.append(
            _row((run.run_id, run.state, steps, *rewards, _num(run.tokens_per_s, ".0f"), wall, pace, run.reason))
        )
    lines += ["", "## Learning curves", "", f"Mean reward per step (faint), smoothed (weight {SMOOTHING}), against"
              " each run's own step.", ""]  # fmt: skip
    settings = {entry.id: run_settings(entry) for entry in _entries(output_dir)}
    curves = {f"{run.run_id} ({settings.get(run.run_id, '')})": _xy(run) for run in view.runs if run.curve}
    if curves:
        plot_learning_curves(curves, plots / "rewards.png", title="mean reward per run", xlabel="step (of each run)",
                             ylabel="mean reward", smoothing=SMOOTHING)  # fmt: skip
        lines.append("![all runs](plots/rewards.png)")
    for run in view.runs:
        if run.curve:
            options = run_figure_options(run, settings.get(run.run_id, ""))
            plot_learning_curves({"reward": _xy(run)}, plots / f"{run.run_id}.png", **options)
            lines.append(f"![{run.run_id}](plots/{run.run_id}.png)")
    lines += _evaluation_section(view, plots)
    lines += _inference_section(view)
    lines += _nodes_section(view, output_dir)
    path = output_dir / REPORT_FILE
    path.write_text("\n".join(lines) + "\n")
    return path


ACCURACY_PREFIX = "eval/accuracy_t"  # the orchestrator's evaluator logs eval/accuracy_t<temperature>


def _evaluation_section(view: JobView, plots: Path) -> list[str]:
    """Each run's held-out accuracy at its first and newest evaluation, per temperature, and the
    curves (x: the policy step evaluated, so a run that joined late starts at its own 0)."""
    runs = [run for run in view.runs if run.evaluations]
    if not runs:
        return []
    temperatures = sorted({float(k.removeprefix(ACCURACY_PREFIX)) for run in runs for row in run.evaluations
                           for k in row if k.startswith(ACCURACY_PREFIX)})  # fmt: skip
    names = ["greedy" if t == 0 else f"t{t:g}" for t in temperatures]
    header = ("run", "evaluations", "policy steps", *(f"{name}: first -> newest (rise)" for name in names))
    lines = ["", "## Held-out evaluation", "", "Accuracy on the same held-out examples at each evaluation (t: the "
             "sampling temperature).", "", _row(header), _row(("---",) * len(header))]  # fmt: skip
    curves: dict[str, tuple[list[float], list[float]]] = {}
    for run in runs:
        rows = sorted(run.evaluations, key=lambda row: row["step"])
        cells = []
        for name, temperature in zip(names, temperatures, strict=True):
            key = f"{ACCURACY_PREFIX}{temperature:g}"
            steps, values = [row["step"] for row in rows if key in row], [row[key] for row in rows if key in row]
            rise = values[-1] - values[0] if values else None
            cells.append(f"{_num(values[0] if values else None)} -> {_num(values[-1] if values else None)} "
                         f"({_num(rise, '+.3f')})")  # fmt: skip
            curves[f"{run.run_id} {name}"] = (steps, values)
        span = f"{int(rows[0]['step'])}..{int(rows[-1]['step'])}"
        lines.append(_row((run.run_id, str(len(rows)), span, *cells)))
    plot_learning_curves(curves, plots / "heldout.png", title="held-out accuracy per run", xlabel="policy step",
                         ylabel="accuracy")  # fmt: skip
    return [*lines, "", "![held-out accuracy](plots/heldout.png)"]


def _inference_section(view: JobView) -> list[str]:
    if view.inference is None:
        return []
    lines = ["", "## Inference", "", f"Engine: **{view.inference.engine}**"]
    if view.inference.engine == "vllm":
        lines.append(f"Servers: {view.inference.replicas} replica(s), one for every run's adapter")
    header = ("run", "rollout tokens/s (mean)", "adapter loads", "load p50 (ms)", "load max (ms)")
    lines += ["", _row(header), _row(("---",) * len(header))]
    for run in view.runs:
        loads = sorted(run.adapter_loads_s)
        tokens = [row for row in run.rollout_tokens_per_s if math.isfinite(row)]
        mean = sum(tokens) / len(tokens) if tokens else None
        p50 = 1000 * loads[len(loads) // 2] if loads else None
        worst = 1000 * loads[-1] if loads else None
        lines.append(_row((run.run_id, _num(mean, ".0f"), str(len(loads)), _num(p50, ".1f"), _num(worst, ".1f"))))
    return lines


def _nodes_section(view: JobView, output_dir: Path) -> list[str]:
    header = ("role", "rank", "state", "restarts", "last cause")
    lines = ["", "## Nodes and restarts", "", _row(header), _row(("---",) * len(header))]
    for node in view.nodes:
        lines.append(_row((node.role, str(node.rank), node.state, str(node.restarts), node.cause)))
    lines += ["", "Trainer rendezvous:", ""] + ([f"- {line}" for line in view.rendezvous] or ["- none"])
    decisions = _decisions(output_dir)
    lines += ["", "## Control-plane decisions", ""] + ([f"- {d}" for d in decisions] or ["- none"])
    evicted = [run for run in view.runs if run.state == "evicted"]
    lines += ["", "## Evictions", ""] + ([f"- {r.run_id}: {r.reason}" for r in evicted] or ["- none"])
    return lines


def _entries(output_dir: Path) -> list[RunEntry]:
    try:
        return read_registry(output_dir)
    except (OSError, RlplexError):  # no registry (a store without a main job): plots without settings
        return []


def _xy(run: RunView) -> tuple[list[float], list[float]]:
    return [step for step, _ in run.curve], [reward for _, reward in run.curve]


def _num(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def _row(cells: tuple[str, ...]) -> str:
    return "| " + " | ".join(cell.replace("|", "/").replace("\n", " ") for cell in cells) + " |"
