"""The end-of-job report: `report.md` with each run's learning curve (PNG), how much its
reward rose, its wall time and time per step, throughput, evictions and restarts, plus
TensorBoard event files per run."""

from __future__ import annotations

import math
import time
from pathlib import Path

from rlplex.diagnostics.plots import plot_learning_curves
from rlplex.mainjob.timing import ETA_WINDOW_STEPS, format_duration
from rlplex.mainjob.view import REWARD_WINDOW, JobView, RunView, collect, open_job_store

REPORT_FILE = "report.md"


def write_tensorboard(run: RunView, directory: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(directory))
    try:
        for step, reward in run.curve:
            writer.add_scalar("charts/reward_mean", reward, int(step))
    finally:
        writer.close()


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
    lines += ["", "## Learning curves", ""]
    curves = {run.run_id: _xy(run) for run in view.runs if run.curve}
    if curves:
        plot_learning_curves(curves, plots / "rewards.png", title="mean reward per run", xlabel="step", ylabel="reward")
        lines.append("![all runs](plots/rewards.png)")
    for run in view.runs:
        if run.curve:
            plot_learning_curves({run.run_id: _xy(run)}, plots / f"{run.run_id}.png", title=run.run_id,
                                 xlabel="step", ylabel="mean reward")  # fmt: skip
            lines.append(f"![{run.run_id}](plots/{run.run_id}.png)")
            write_tensorboard(run, output_dir / "tb" / run.run_id)
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


def _xy(run: RunView) -> tuple[list[float], list[float]]:
    return [step for step, _ in run.curve], [reward for _, reward in run.curve]


def _num(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def _row(cells: tuple[str, ...]) -> str:
    return "| " + " | ".join(cell.replace("|", "/").replace("\n", " ") for cell in cells) + " |"
