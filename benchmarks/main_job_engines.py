"""The main job with rollouts on vLLM beside the same job generating in process (`hf`).

    python -m benchmarks.main_job_engines [--quick] [--steps 40]
    python -m benchmarks.main_job_engines --job examples/smollm2_arithmetic.toml --steps 6

Runs `examples/multirun_demo.toml` (or `--job`: any main job, e.g. SmolLM2's) twice, one after
the other on the same machine, with `[inference] engine = "hf"` and then `"vllm"` (every run's
`max_steps` cut to `--steps`, no later runs, events or held-out evaluations, the demo's noisy
run left out), each to completion with `rlplex run`'s own driver. Reports each side's wall time
(job creation to report), aggregate trainer tokens/s over the wall time, mean rollout tokens/s
per run, and the reward rise per run, and the ratios vLLM / hf.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.common import report
from rlplex.config import read_toml, validate_config
from rlplex.mainjob.config import MainJobConfig
from rlplex.mainjob.driver import run_main_job
from rlplex.mainjob.view import collect
from rlplex.models.tiny import TinyModelConfig, build_tiny_model

NAME = "main_job_engines"
ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "multirun_demo.toml"


def job_config(engine: str, steps: int, output_dir: Path, job: Path = DEMO) -> MainJobConfig:
    data: dict[str, Any] = read_toml(job)
    data["output_dir"] = str(output_dir)
    data["name"] = f"bench-{engine}"
    data["inference"] = {**data.get("inference", {}), "engine": engine}
    data["events"] = []
    data["later_runs"] = []
    runs = [entry for entry in data["runs"] if entry["id"] != "run_noisy"]
    for entry in runs:
        entry["config"] = {**entry["config"], "max_steps": steps}
        entry["config"].pop("evaluation", None)
    data["runs"] = runs
    data["model"] = {**data["model"], "name": str(ROOT / data["model"]["name"])}
    return validate_config(MainJobConfig, data, source=str(job))


def run_side(engine: str, steps: int, job: Path = DEMO) -> dict[str, Any]:
    out = ROOT / "outputs" / f"bench-main-job-{engine}"
    shutil.rmtree(out, ignore_errors=True)
    config = job_config(engine, steps, out, job)
    started = time.monotonic()
    with open(out.parent / f"bench-main-job-{engine}.log", "w") as log:
        state = run_main_job(config, Console(file=log), live=False)
    wall = time.monotonic() - started
    view = collect(out)
    rollout = [sum(r.rollout_tokens_per_s) / len(r.rollout_tokens_per_s) for r in view.runs if r.rollout_tokens_per_s]
    return {
        "engine": engine,
        "state": state.value,
        "wall_s": wall,
        "trainer_tokens_per_s": view.trained_tokens / wall,
        "rollout_tokens_per_s_per_run": sum(rollout) / max(len(rollout), 1),
        "reward_rise": {r.run_id: r.reward_rise for r in view.runs},
        "reward_end": {r.run_id: r.reward_end for r in view.runs},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="6 steps per run")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--job", type=Path, default=DEMO, help="the main job file (default: the demo's)")
    args = parser.parse_args(argv)
    steps = 6 if args.quick else args.steps
    if args.job.resolve() == DEMO:  # another job's model is its own to build (`rlplex model smollm2 ...`)
        build_tiny_model(ROOT / "outputs" / "models" / "tiny-reverse", TinyModelConfig(warmup_steps=110), replace=True)
    sides = [run_side(engine, steps, args.job.resolve()) for engine in ("hf", "vllm")]
    hf, vllm = sides
    rows = [
        (s["engine"], s["state"], s["wall_s"], s["trainer_tokens_per_s"], s["rollout_tokens_per_s_per_run"],
         " ".join(f"{k}:{v:+.3f}" for k, v in s["reward_rise"].items() if v is not None))
        for s in sides
    ]  # fmt: skip
    ratios = {
        "wall_time_vllm_over_hf": vllm["wall_s"] / hf["wall_s"],
        "trainer_tokens_per_s_vllm_over_hf": vllm["trainer_tokens_per_s"] / hf["trainer_tokens_per_s"],
        "rollout_tokens_per_s_vllm_over_hf": vllm["rollout_tokens_per_s_per_run"]
        / max(hf["rollout_tokens_per_s_per_run"], 1e-9),
    }
    rows.append(("vllm / hf", "", ratios["wall_time_vllm_over_hf"], ratios["trainer_tokens_per_s_vllm_over_hf"],
                 ratios["rollout_tokens_per_s_vllm_over_hf"], ""))  # fmt: skip
    columns = ("engine", "job", "wall s", "trainer tokens/s", "rollout tokens/s per run", "reward rise")
    figures = {"steps": steps, "sides": sides, **ratios}
    figures["job"] = str(args.job)
    report(NAME, f"main job {args.job.name}, {steps} steps per run: hf vs vLLM", columns, rows, figures)


if __name__ == "__main__":
    main()
