"""rlplex's main job side by side with TRL's GRPOTrainer with peft LoRA (issue 29, item 4).

    python -m benchmarks.vs_trl [--model tiny|smollm2|PATH] [--case A|B|both] [--steps N]
                                [--quick] [--trl-threads N]

Needs trl, a bench-only dependency: `pip install -r requirements-bench.txt` (`make bench` does).

Both sides are commands started from here, each timed from its start to its exit (imports,
model loading and the final save included), with the PSS of all their processes (each
command's whole process tree) sampled every 0.5 s, their peak reported:
- rlplex: `rlplex run JOB.toml --no-live`, a main job (engine hf, one trainer rank).
- TRL: `python -m benchmarks.vs_trl_worker trl RUN.json`, a GRPOTrainer with a peft LoRA on
  the same layers of the same model folder. Its reward is the rlplex environment's own
  `score()`, on the problems the rlplex run draws (same seeds: the same problems step by
  step), rendered with the same chat template.
Case A: one run. Case B: three runs that differ in learning rate (and seed): rlplex's one job
with three runs, against TRL three times back to back and three TRL processes at once.

Matched on both sides: model, task, reward, prompts per step and group size (rlplex's
batch_size is prompts x group), max new tokens, temperature (top-p 1, no top-k), LoRA rank,
alpha and target layers, AdamW at the same learning rate on rlplex's schedule (linear down to
0.1x over the steps), gradient clipping at 1.0, one optimizer step per batch, PPO clip 0.2 with
a token-level loss over the step's tokens (TRL's "dapo"), no KL term, float32 on the CPU, steps.
Threads: rlplex's job as it runs (one trainer rank, orchestrators at torch's default); TRL at
its best thread count (`--trl-threads`; default 1: on 2 cores 1 beat 2 on both models), each
of three TRL processes at once a third of it (at least 1). TRL's micro-batch: 32 rows on the
tiny model, 8 on SmolLM2 (32 peaked at 14 GB; three at once must fit).
Not matched, TRL has no such setting: rlplex generates step s+1 while it trains step s
(max_async_level 1: rollouts one step off-policy, corrected by the clipped ratio); TRL scales
advantages by the sample std of a group, rlplex by the population std (a constant factor).

Figures per side: wall time, generated tokens/s (completion tokens over that wall time), peak
PSS, reward per step (plotted to bench_results/vs_trl_<model>_<case>.png), and held-out accuracy
before and after (greedy; sampled too on the tiny model), measured afterwards, outside both
timings, with `rlplex.models.lm.evaluate` on the same held-out problems, each final adapter
loaded with peft. The table goes to stdout, the figures to bench_results/vs_trl.json (SmolLM2;
vs_trl_<model>.json for the others).

Goals (SmolLM2-135M on the CPU): case A, rlplex's wall time <= 0.9x TRL's; case B, rlplex's job
<= 0.8x three TRL processes at once and <= 0.5x three back to back, its peak PSS <= 0.5x the
three processes'; reward per step within noise of TRL's.

This process imports neither torch nor trl until every command has ended: a library it mapped
would share its pages with the commands and lower their PSS.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.process_memory import tree_pss_mb
from benchmarks.vs_trl_runs import (
    COMMAND_TIMEOUT_S,
    INSTALL_HINT,
    Preset,
    RunSettings,
    TrlJob,
    case_runs,
    job_toml,
    preset_for,
    rlplex_job_data,
    trl_micro_batch,
)

NAME = "vs_trl"
ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
OUTPUTS = ROOT / "outputs" / "bench-vs-trl"
PSS_INTERVAL_S = 0.5
REWARD_WINDOW = 10  # steps averaged for "reward start" and "reward end", as rlplex's report


# --- commands ---------------------------------------------------------------------------------


def command_env(threads: int | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(ROOT)])}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


@dataclass
class Command:
    argv: list[str]
    env: dict[str, str]
    log: Path


@dataclass
class Measured:
    wall_s: float
    peak_pss_mb: float
    processes: int  # commands
    ended_s: list[float] = field(default_factory=list)  # each command's seconds from the start


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each command's process group (each started in a session of its own), then SIGKILL."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_at_once(commands: Sequence[Command], timeout_s: float = COMMAND_TIMEOUT_S) -> Measured:
    """Start the commands together; wall time until the last exits, and the peak of their
    processes' PSS summed at each sample."""
    procs: list[subprocess.Popen[bytes]] = []
    ended: dict[int, float] = {}
    peak, next_sample = 0.0, 0.0
    started = time.perf_counter()
    try:
        for command in commands:
            command.log.parent.mkdir(parents=True, exist_ok=True)
            with command.log.open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        command.argv, env=command.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        while len(ended) < len(procs):
            now = time.perf_counter()
            for i, proc in enumerate(procs):
                if i not in ended and proc.poll() is not None:
                    ended[i] = now - started
            if now >= next_sample:
                peak = max(peak, sum(tree_pss_mb(p.pid) for p in procs if p.poll() is None))
                next_sample = now + PSS_INTERVAL_S
            if now - started > timeout_s:
                raise RuntimeError(f"timed out after {timeout_s:.0f} s: {[c.argv for c in commands]}")
            time.sleep(0.02)
    finally:
        _stop(procs)
    for command, proc in zip(commands, procs, strict=True):
        if proc.returncode != 0:
            tail = command.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{' '.join(command.argv)} exited {proc.returncode}; {command.log}:\n{tail}")
    return Measured(max(ended.values()), peak, len(commands), [ended[i] for i in range(len(procs))])


def run_back_to_back(commands: Sequence[Command]) -> Measured:
    """One command after the other: their wall times add up, the peak PSS is the largest one's."""
    parts = [run_at_once([command]) for command in commands]
    ends = [sum(p.wall_s for p in parts[: i + 1]) for i in range(len(parts))]
    return Measured(sum(p.wall_s for p in parts), max(p.peak_pss_mb for p in parts), len(parts), ends)


def rlplex_command(runs: Sequence[RunSettings], output_dir: Path) -> Command:
    shutil.rmtree(output_dir, ignore_errors=True)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    job_file = output_dir.parent / f"{output_dir.name}.toml"
    job_file.write_text(job_toml(rlplex_job_data(runs, output_dir, f"bench-{output_dir.name}")))
    argv = [sys.executable, "-m", "rlplex.cli", "run", str(job_file), "--no-live"]
    return Command(argv, command_env(), output_dir.parent / f"{output_dir.name}.log")


def trl_command(run: RunSettings, output_dir: Path, threads: int, micro_rows: int) -> Command:
    shutil.rmtree(output_dir, ignore_errors=True)
    output_dir.mkdir(parents=True)
    job = TrlJob(run=run, threads=threads, micro_batch=trl_micro_batch(run, micro_rows), output_dir=str(output_dir))
    config = output_dir / "trl_job.json"
    config.write_text(job.model_dump_json(indent=2))
    argv = [sys.executable, "-m", "benchmarks.vs_trl_worker", "trl", str(config)]
    return Command(argv, command_env(threads), output_dir / "trl.log")


def prepare_model(model: str) -> str:
    """The model folder (tiny and smollm2 built once, in a process of their own: torch stays out of this one)."""
    argv = [sys.executable, "-m", "benchmarks.vs_trl_worker", "model", model]
    done = subprocess.run(argv, env=command_env(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"cannot prepare the model {model!r}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


# --- results ----------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One run's figures, either side."""

    rewards: list[float]
    generated_tokens: int
    adapter: Path
    heldout: dict[str, float] = field(default_factory=dict)  # "t0" / "t1" -> accuracy after


def read_rlplex_run(output_dir: Path, run: RunSettings) -> RunResult:
    """The orchestrator's reward and generated tokens per step, and the last broadcast adapter."""
    from rlplex.multirun.rundir import RunDir

    run_dir = RunDir(output_dir / "runs", run.run_id)
    with open(run_dir.root / "progress.csv", newline="") as handle:
        rows = sorted(csv.DictReader(handle), key=lambda row: float(row["step"]))
    rewards = [float(row["charts/reward_mean"]) for row in rows]
    tokens = sum(int(float(row["charts/generated_tokens"])) for row in rows)
    return RunResult(rewards, tokens, run_dir.broadcast_step(run.steps))


def read_trl_run(output_dir: Path) -> RunResult:
    """What the worker wrote: the reward and generated tokens of each generation (one per step)."""
    data = json.loads((output_dir / "result.json").read_text())
    return RunResult(data["rewards"], sum(data["generated_tokens"]), Path(data["adapter"]))


@dataclass
class Side:
    """One way of running a case: its command(s) measured, and its runs' results."""

    label: str
    measured: Measured
    runs: dict[str, RunResult]
    threads: int | None = None  # TRL's torch threads per process

    @property
    def generated_tokens(self) -> int:
        return sum(run.generated_tokens for run in self.runs.values())

    def summary(self) -> dict[str, Any]:
        return {
            "wall_s": self.measured.wall_s,
            "command_ends_s": self.measured.ended_s,
            "processes": self.measured.processes,
            "peak_pss_mb": self.measured.peak_pss_mb,
            "generated_tokens": self.generated_tokens,
            "generated_tokens_per_s": self.generated_tokens / self.measured.wall_s,
            "trl_threads": self.threads,
            "runs": {
                run_id: {
                    "rewards": run.rewards,
                    "reward_start": window_mean(run.rewards, newest=False),
                    "reward_end": window_mean(run.rewards, newest=True),
                    "generated_tokens": run.generated_tokens,
                    "heldout_after": run.heldout,
                    "adapter": str(run.adapter),
                }
                for run_id, run in self.runs.items()
            },
        }


def window_mean(values: Sequence[float], newest: bool) -> float | None:
    """The mean of the first (or newest) steps, REWARD_WINDOW or half of them, as rlplex's report."""
    if not values:
        return None
    window = max(1, min(REWARD_WINDOW, len(values) // 2))
    chosen = values[-window:] if newest else values[:window]
    return sum(chosen) / len(chosen)


def reward_gap(ours: Sequence[float], theirs: Sequence[float]) -> dict[str, float | bool]:
    """rlplex's minus TRL's mean reward over the second half of the steps, against twice the
    standard error of that difference (each side's step-to-step spread over that half)."""

    def half(values: Sequence[float]) -> list[float]:
        return list(values[len(values) // 2 :])

    def mean_and_var(values: list[float]) -> tuple[float, float]:
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
        return mean, var / len(values)

    (m1, v1), (m2, v2) = mean_and_var(half(ours)), mean_and_var(half(theirs))
    noise = 2 * math.sqrt(v1 + v2)
    return {"gap": m1 - m2, "noise": noise, "within_noise": abs(m1 - m2) <= noise}


def evaluate_heldout(
    preset: Preset, run: RunSettings, adapters: Sequence[Path], examples: int
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Held-out accuracy per temperature of the base model and of each adapter (loaded with peft,
    merged): `rlplex.models.lm.evaluate` on the run's held-out problems, those (and the sampling
    seed) an rlplex run's own evaluation takes. The runs of a case share them: any one serves."""
    import numpy as np
    import torch
    from peft import PeftModel

    from rlplex.models.hf import load_causal_lm, load_tokenizer
    from rlplex.models.lm import evaluate
    from rlplex.models.spec import ModelSpec
    from rlplex.multirun.orchestrator.config import EvaluationConfig
    from rlplex.tasks import EnvSpec, load_environment

    torch.set_num_threads(os.cpu_count() or 1)
    settings = EvaluationConfig(examples=examples, temperatures=list(preset.temperatures))
    env = load_environment(settings.env_spec(EnvSpec(**run.env)))
    problems = env.sample(examples, np.random.default_rng(settings.seed))
    spec = ModelSpec(name=run.model)
    tokenizer = load_tokenizer(spec)

    def accuracy(model: torch.nn.Module) -> dict[str, float]:
        scores = {t: evaluate(model, tokenizer, env, problems, t, settings.seed, max_new_tokens=run.max_new_tokens)
                  for t in settings.temperatures}  # fmt: skip
        return {f"t{t:g}": score.accuracy for t, score in scores.items()}

    base = accuracy(load_causal_lm(spec, torch.device("cpu")))
    after = []
    for adapter in adapters:
        model = PeftModel.from_pretrained(load_causal_lm(spec, torch.device("cpu")), str(adapter)).merge_and_unload()
        after.append(accuracy(model))
    return base, after


# --- the cases --------------------------------------------------------------------------------


def run_case(case: str, runs: list[RunSettings], trl_threads: int, micro_rows: int) -> list[Side]:
    """Every side of one case, measured one after the other (never two sides at once)."""
    base = OUTPUTS / f"{Path(runs[0].model).name}-{case}"
    print(f"case {case}: rlplex, one job with {len(runs)} run(s) ...", flush=True)
    rlplex_dir = base / "rlplex"
    measured = run_at_once([rlplex_command(runs, rlplex_dir)])
    sides = [Side(f"rlplex, one job of {len(runs)} run(s)", measured, {})]
    trl_sides = [(f"TRL, {trl_threads} thread(s)" if len(runs) == 1 else "TRL x3 back to back", "trl", trl_threads)]
    if len(runs) > 1:
        trl_sides.append(("TRL x3 at once", "trl-at-once", max(1, trl_threads // len(runs))))
    for label, folder, threads in trl_sides:
        print(f"case {case}: {label} ...", flush=True)
        commands = [trl_command(run, base / folder / run.run_id, threads, micro_rows) for run in runs]
        at_once = folder == "trl-at-once"
        measured = run_at_once(commands) if at_once else run_back_to_back(commands)
        sides.append(Side(label, measured, {}, threads))
    # Everything measured: results are read (torch may come in now).
    sides[0].runs = {run.run_id: read_rlplex_run(rlplex_dir, run) for run in runs}
    for side, (_, folder, _) in zip(sides[1:], trl_sides, strict=True):
        side.runs = {run.run_id: read_trl_run(base / folder / run.run_id) for run in runs}
    return sides


def case_figures(
    case: str, preset: Preset, runs: list[RunSettings], sides: list[Side], examples: int
) -> tuple[dict[str, Any], list[list[Any]]]:
    print(f"case {case}: held-out evaluation ...", flush=True)
    results = [result for side in sides for result in side.runs.values()]
    before, after = evaluate_heldout(preset, runs[0], [result.adapter for result in results], examples)
    for result, accuracy in zip(results, after, strict=True):
        result.heldout = accuracy
    rlplex, trl = sides[0], sides[1:]
    figures: dict[str, Any] = {
        "runs": [run.model_dump() for run in runs],
        "heldout_before": before,
        "sides": {side.label: side.summary() for side in sides},
        "wall_ratio": {other.label: rlplex.measured.wall_s / other.measured.wall_s for other in trl},
        "pss_ratio": {other.label: rlplex.measured.peak_pss_mb / other.measured.peak_pss_mb for other in trl},
        "reward_gap": {run.run_id: reward_gap(rlplex.runs[run.run_id].rewards, trl[0].runs[run.run_id].rewards)
                       for run in runs},
    }  # fmt: skip
    rows = []
    for side in sides:
        results = list(side.runs.values())
        rows.append(
            [
                case,
                side.label,
                side.measured.wall_s,
                side.generated_tokens / side.measured.wall_s,
                side.measured.peak_pss_mb,
                _joined(window_mean(r.rewards, newest=False) for r in results),
                _joined(window_mean(r.rewards, newest=True) for r in results),
                _joined([before.get("t0")]),
                _joined(r.heldout.get("t0") for r in results),
                _joined([before.get("t1")]),
                _joined(r.heldout.get("t1") for r in results),
            ]
        )
    return figures, rows


def _joined(values: Any) -> str:
    shown = [f"{v:.2f}" for v in values if v is not None]
    return " / ".join(shown) if shown else "-"


def goals(label: str, figures: dict[str, Any]) -> dict[str, Any]:
    """The issue's goals, checked on whatever cases ran (they are set for SmolLM2)."""
    met: dict[str, Any] = {"model": label, "set_for": "smollm2"}
    if "A" in figures:
        (ratio,) = figures["A"]["wall_ratio"].values()
        met["A_wall_at_most_0.9x_trl"] = ratio <= 0.9
    if "B" in figures:
        wall, pss = figures["B"]["wall_ratio"], figures["B"]["pss_ratio"]
        met["B_wall_at_most_0.8x_trl_at_once"] = wall["TRL x3 at once"] <= 0.8
        met["B_wall_at_most_0.5x_trl_back_to_back"] = wall["TRL x3 back to back"] <= 0.5
        met["B_peak_pss_at_most_0.5x_trl_at_once"] = pss["TRL x3 at once"] <= 0.5
    gaps = [gap for case in ("A", "B") if case in figures for gap in figures[case]["reward_gap"].values()]
    met["reward_within_noise"] = all(gap["within_noise"] for gap in gaps)
    return met


def plot_rewards(label: str, case: str, sides: list[Side]) -> str:
    from benchmarks.common import RESULTS
    from rlplex.diagnostics.plots import plot_learning_curves

    curves, styles = {}, {}
    for side, linestyle in zip(sides[:2], ("-", "--"), strict=False):
        for number, (run_id, run) in enumerate(side.runs.items()):
            name = f"{'rlplex' if side is sides[0] else 'TRL'} {run_id.removeprefix('run_')}"
            curves[name] = (list(range(len(run.rewards))), run.rewards)
            styles[name] = {"color": f"C{number}", "linestyle": linestyle}
    png = RESULTS / f"{NAME}_{label}_{case}.png"
    plot_learning_curves(curves, png, title=f"{label}: reward per step, case {case}", xlabel="step",
                         ylabel="mean reward", styles=styles)  # fmt: skip
    return str(png)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default=None, help="tiny, smollm2 or a model folder (default: smollm2 when installed)"
    )
    parser.add_argument("--case", choices=("A", "B", "both"), default="both")
    parser.add_argument("--steps", type=int, default=None, help="steps of every run (default: the model's, A and B)")
    parser.add_argument("--quick", action="store_true", help="the tiny model, 3 steps, 16 held-out problems")
    parser.add_argument("--trl-threads", type=int, default=None, help="TRL's torch threads (default: the model's best)")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("trl") is None:
        raise SystemExit(INSTALL_HINT)
    model = "tiny" if args.quick else (args.model or default_model())
    preset = preset_for(model)
    steps_a, steps_b = (3, 3) if args.quick else (args.steps or preset.steps_a, args.steps or preset.steps_b)
    examples = 16 if args.quick else preset.heldout_examples
    trl_threads = args.trl_threads or preset.trl_threads
    model_dir = prepare_model(model)
    label = preset.label if model in ("tiny", "smollm2") else Path(model_dir).name
    cases = ["A", "B"] if args.case == "both" else [args.case]
    measured = {}
    for case in cases:
        runs = case_runs(preset, model_dir, case, steps_a if case == "A" else steps_b)
        measured[case] = (runs, run_case(case, runs, trl_threads, preset.trl_micro_rows))
    figures: dict[str, Any] = {"model": model_dir, "label": label, "trl_threads": trl_threads}
    rows: list[list[Any]] = []
    for case, (runs, sides) in measured.items():
        figures[case], case_rows = case_figures(case, preset, runs, sides, examples)
        figures[case]["plot"] = plot_rewards(label, case, sides)
        rows += case_rows
    figures["goals"] = goals(label, figures)
    title = f"{label}: rlplex's main job vs TRL GRPOTrainer; " + "; ".join(
        f"case {case} rlplex/TRL wall " + ", ".join(f"{r:.2f}x" for r in figures[case]["wall_ratio"].values())
        for case in cases
    )
    columns = ("case", "side", "wall s", "gen tokens/s", "peak PSS MB", "reward start", "reward end",
               "greedy before", "greedy after", "sampled before", "sampled after")  # fmt: skip
    from benchmarks.common import report

    report(NAME if label == "smollm2" else f"{NAME}_{label}", title, columns, rows, figures)


def default_model() -> str:
    """smollm2 when its package is installed, else tiny (as benchmarks.multirun_throughput)."""
    from rlplex.errors import ConfigError
    from rlplex.models.gguf import smollm2_gguf

    try:
        smollm2_gguf()
    except ConfigError:
        return "tiny"
    return "smollm2"


if __name__ == "__main__":
    main()
