"""It must learn: three runs with different learning rates and LoRA ranks share one trainer,
then each run is trained alone with the same seed; the reward curves are compared.

    python -m benchmarks.multirun_learning [--quick] [--steps N] [--warmup-steps W] [--parallel 2]
    python -m benchmarks.multirun_learning --preset arithmetic
    python -m benchmarks.multirun_learning --env-json '{"name": "arithmetic", "max_operand": 9}' \
        --model-json '{"hidden_size": 128, "intermediate_size": 384}' --warmup-steps 200

Shared: one `python -m rlplex.multirun.trainer --max-runs 3` and one
`python -m rlplex.multirun.orchestrator` per run, all real processes on one output directory.
Alone: per run its own trainer (`--max-runs 1`) and orchestrator on a fresh output directory,
`--parallel` of them at a time. Every process runs with one thread. The reward of a step is the
mean task reward of that step's rollouts (the orchestrator's `progress.csv`).

Settings, and why (reverse task, 2 CPU cores): the base is rlplex's tiny Hugging Face checkpoint
(`rlplex model tiny`, a Qwen2 model with a BPE tokenizer trained on the spot) warmed up for
`--warmup-steps` supervised steps (default 75), so that its sampled reward starts below the
0.7 goal while LoRA RL still has a signal to sharpen: sampled (temperature 1) / greedy reward on
512 problems was 0.15 / 0.41 after 40 steps, 0.42 / 0.66 after 60, 0.57 / 0.75 after 70,
0.69 / 0.82 after 80 and 0.85 / 0.94 after 120 (`rlplex model tiny`'s default). From 60 and 70
warm-up steps the well-configured runs rose by about 0.1 in 200 steps but ended at 0.53 and 0.68.
200 steps of 128 samples (16 prompts x 8) per run. Temperature stays 1:
the trainer scores tokens with untempered log-probabilities, so a run sampling at another
temperature trains on wrong importance ratios (at 1.5 the reward collapsed).
Runs: run_a (lr 3e-3, rank 8) and run_b (lr 5e-3, rank 4) are the well-configured runs;
run_c (lr 1e-4, rank 2) is a control whose learning rate is too small to move in 200 steps.
LoRA alpha = 2 x rank for every run.

Runs are synchronous (`max_async_level = 0`) by default: with one step of lag, which adapter a
step samples with depends on process timing, and shared and alone would differ by scheduling,
not by anything the trainer computes. The base model is warmed up only so far (`--warmup-steps`)
that its reward starts well below the 0.7 goal. `--seed-check` (default on) trains the first
run alone a second time with another orchestrator seed: the gap between those two curves is
the seed-to-seed noise that the shared-vs-alone gap is judged against.

Goal (issue 5): every well-configured run reaches a final reward >= 0.7, and each run's curve
matches the same run trained alone within noise. Curves to PNG (shared solid, alone dashed).

Other environments: `--env-json` names an environment with its settings (it replaces `--task`),
and `--model-json` sets the tiny checkpoint's `TinyModelConfig` (its warm-up `tasks` default to
that environment, `warmup_steps` to `--warmup-steps`). `--preset arithmetic` picks the settings
below, under which every well-configured run's reward rises by at least `--min-rise` (0.2): the
mean of its last 10 steps over the mean of its first 10 (the `rise` column).
"""

from __future__ import annotations

import argparse
import csv
import json
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, report, tiny_checkpoint
from benchmarks.curves import curve_gap, curve_summary, smooth
from benchmarks.multirun_throughput import process_env, trainer_command
from rlplex.diagnostics import plot_learning_curves
from rlplex.multirun import OrchestratorConfig
from rlplex.multirun.orchestrator.config import orch_config_to_toml
from rlplex.multirun.rundir import RunDir

NAME = "multirun_learning"
REWARD = "charts/reward_mean"


@dataclass(frozen=True)
class RunSpec:
    run_id: str
    lr: float
    rank: int
    well_configured: bool  # expected to reach the target within the budget


# alpha = 2 * rank: the same adapter scale for every rank, so that lr and rank are the only knobs.
DEFAULT_SPECS = (
    RunSpec("run_a", 3e-3, 8, True),
    RunSpec("run_b", 5e-3, 4, True),
    RunSpec("run_c", 1e-4, 2, False),  # deliberately too small a learning rate: a control that stays low
)


@dataclass(frozen=True)
class Budget:
    task: str = "reverse"
    steps: int = 200
    batch_size: int = 128
    group_size: int = 8
    warmup_steps: int = 75
    temperature: float = 1.0
    max_async_level: int = 0
    timeout_s: float = 1800.0  # per group of processes
    # The environment with its settings, e.g. {"name": "arithmetic", "max_operand": 9}; None: `task`
    # with its default settings (and the same cached checkpoint as before these fields existed).
    env: dict[str, Any] | None = None
    # `TinyModelConfig` settings of the base checkpoint, over `tasks` = the environment and `warmup_steps`.
    model: dict[str, Any] | None = None

    def env_spec(self) -> dict[str, Any]:
        return dict(self.env) if self.env is not None else {"name": self.task}

    def settings_label(self) -> str:
        """The environment's settings for titles ("" when it has none)."""
        spec = self.env_spec()
        spec.pop("name")
        return json.dumps(spec, separators=(",", ":")) if spec else ""


@dataclass
class GroupResult:
    curves: dict[str, list[float]]
    seconds: float


@dataclass(frozen=True)
class Preset:
    budget: Budget
    specs: tuple[RunSpec, ...]
    target: float  # drawn as the horizontal line; the goal of a preset is its rise


# Arithmetic on the tiny checkpoint (2 CPU cores, the whole command well within 15 minutes).
# Measured on the default tiny model (64 wide, 2 layers, warm-up lr 3e-3); accuracies over 512
# problems, sampled at T=1 and greedy; RL runs with batch 128 unless said otherwise.
# - Environment: products of factors 2..7 (36 pairs). The default (operands up to 20, add and
#   subtract) is beyond this model in a CPU warm-up: after 300 steps it samples 0.08, greedy 0.13.
#   Additions up to 9 are learnt, but RL from there climbs slowly (+0.08 in 60 steps of 64 from
#   sampled 0.36 / greedy 0.63): its errors are off-by-one guesses that RL has to learn away
#   problem by problem. A small times table is memorised, and RL sharpens it quickly.
# - Warm-up: 125 steps, where the table is half learnt and the gap to greedy is widest: sampled
#   0.41, greedy 0.74 (at 120: 0.39 / 0.60; at 140: 0.63 / 0.89). RL brings the sampled reward up
#   to about the greedy accuracy, not much past it, so that gap is what a run can gain. A lower
#   warm-up lr widens the gap (lr 1e-3, 140 steps of 6x6: 0.44 / 0.96) but RL gains nothing
#   there: only the LoRA adapters train, the embeddings and final norm stay as small as the
#   short warm-up left them, so the logits cannot get much sharper.
# - Runs: DEFAULT_SPECS (lr 3e-3 and 5e-3 learn alike). Higher is worse: at lr 1e-2 (rank 8) an
#   addition run first fell from 0.34 to about 0.15, at 2e-2 it fell in 4 steps to batches with no
#   correct answer and its orchestrator gave up. 128 samples a step (16 prompts): with 8 prompts
#   the mean of 10 steps swings by +-0.05 with the problems drawn, as much as the trend it measures.
ARITHMETIC = Preset(
    Budget(
        task="arithmetic",
        env={"name": "arithmetic", "max_operand": 7, "operations": ["multiply"]},
        warmup_steps=125,
        steps=120,
        batch_size=128,
        group_size=8,
    ),
    DEFAULT_SPECS,
    target=0.7,
)
PRESETS: dict[str, Preset] = {"arithmetic": ARITHMETIC}


def model_settings(budget: Budget) -> dict[str, Any]:
    """The `TinyModelConfig` settings of the run's base checkpoint."""
    # A bare task name for the default, so that `--task reverse` keeps its cached checkpoint (the
    # cache key hashes the settings, and "reverse" and {"name": "reverse"} hash differently).
    tasks = (budget.task,) if budget.env is None else (budget.env_spec(),)
    return {"tasks": tasks, "warmup_steps": budget.warmup_steps, **(budget.model or {})}


def base_model(budget: Budget) -> str:
    return str(tiny_checkpoint(**model_settings(budget)))


def orch_config(spec: RunSpec, budget: Budget, seed: int) -> OrchestratorConfig:
    return OrchestratorConfig.model_validate(
        {
            "env": budget.env_spec(),
            "seed": seed,
            "max_steps": budget.steps,
            "batch_size": budget.batch_size,
            "group_size": budget.group_size,
            "temperature": budget.temperature,
            "max_async_level": budget.max_async_level,
            "model": {"name": base_model(budget), "lora": {"rank": spec.rank, "alpha": 2.0 * spec.rank}},
            "optim": {"lr": spec.lr},
        }
    )


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def read_rewards(output_dir: Path, run_id: str) -> list[float]:
    """The mean reward per step from the orchestrator's `progress.csv`, in step order."""
    with open(RunDir(output_dir, run_id).root / "progress.csv", newline="") as handle:
        rows = sorted(csv.DictReader(handle), key=lambda row: float(row["step"]))
    return [float(row[REWARD]) for row in rows]


def train_group(output_dir: Path, specs: Sequence[RunSpec], budget: Budget, seed: int) -> GroupResult:
    """One trainer (`--max-runs len(specs)`) and one orchestrator per run, to the end of every run."""
    output_dir.mkdir(parents=True)
    configs, logs = output_dir / "configs", output_dir / "logs"  # not run_*: the trainer's scan ignores them
    configs.mkdir()
    logs.mkdir()
    paths = []
    for spec in specs:
        path = configs / f"{spec.run_id}.toml"
        path.write_text(orch_config_to_toml(orch_config(spec, budget, seed)))
        paths.append(path)
    env = process_env(1)
    trainer_args = ["--max-lora-rank", str(max(s.rank for s in specs)), "--model", base_model(budget)]
    trainer_args += ["--checkpoint-every", str(budget.steps)]
    orchestrator = [sys.executable, "-m", "rlplex.multirun.orchestrator"]
    orchestrator_args = ["--no-tensorboard", "--wait-timeout", str(budget.timeout_s)]
    procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def start(name: str, command: list[str]) -> subprocess.Popen[bytes]:
        log_path = logs / f"{name}.log"
        with open(log_path, "wb") as handle:
            proc = subprocess.Popen(command, env=env, stdout=handle, stderr=subprocess.STDOUT)
        procs.append((name, proc, log_path))
        return proc

    t0 = time.perf_counter()
    try:
        trainer = start("trainer", trainer_command(output_dir, len(specs), 1, *trainer_args))
        orchestrators = [
            start(
                spec.run_id,
                [*orchestrator, str(output_dir), spec.run_id, str(path), *orchestrator_args],
            )
            for spec, path in zip(specs, paths, strict=True)
        ]
        deadline = time.monotonic() + budget.timeout_s
        while any(p.poll() is None for p in orchestrators):
            for name, proc, log_path in procs:
                code = proc.poll()
                if code not in (None, 0) or (proc is trainer and code is not None):
                    raise RuntimeError(f"{output_dir}: {name} exited {code}:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{output_dir}: runs not done after {budget.timeout_s:g} s")
            time.sleep(0.2)  # polling processes that run for minutes; nothing to synchronise on
        for name, proc, log_path in procs[1:]:
            if proc.returncode != 0:
                raise RuntimeError(f"{output_dir}: {name} exited {proc.returncode}:\n{_tail(log_path)}")
        seconds = time.perf_counter() - t0
        trainer.send_signal(signal.SIGTERM)  # the trainer's graceful stop
        trainer.wait(timeout=120)
    finally:
        for _, proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return GroupResult({spec.run_id: read_rewards(output_dir, spec.run_id) for spec in specs}, seconds)


# ---- the benchmark -------------------------------------------------------------------------------
def run_benchmark(
    workdir: Path,
    specs: Sequence[RunSpec] = DEFAULT_SPECS,
    budget: Budget = Budget(),
    *,
    seed: int = 0,
    seed_check: bool = True,
    parallel: int = 2,
    window: int = 10,
    tail: int = 10,
    target: float = 0.7,
    min_rise: float = 0.2,
    name: str = NAME,
) -> dict[str, Any]:
    """Train shared, then alone; write `bench_results/<name>.json` and `.png`; return the figures."""
    tail, window = max(1, min(tail, budget.steps // 2)), max(1, min(window, budget.steps))
    shared = train_group(workdir / "shared", specs, budget, seed)
    jobs = [(f"alone_{s.run_id}", [s], seed) for s in specs]
    if seed_check:
        jobs.append((f"alone_{specs[0].run_id}_seed{seed + 1}", [specs[0]], seed + 1))
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        futures = {label: pool.submit(train_group, workdir / label, group, budget, s) for label, group, s in jobs}
        alone = {label: future.result() for label, future in futures.items()}
    seed_gap = None
    if seed_check:
        first = specs[0].run_id
        seed_gap = curve_gap(
            alone[f"alone_{first}"].curves[first], alone[f"alone_{first}_seed{seed + 1}"].curves[first], window
        )
    runs, rows, curves, styles = [], [], {}, {}
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    for i, spec in enumerate(specs):
        mine, solo = shared.curves[spec.run_id], alone[f"alone_{spec.run_id}"].curves[spec.run_id]
        s_sum, a_sum = (curve_summary(c, window, tail, target) for c in (mine, solo))
        gap = curve_gap(mine, solo, window)
        noise_ref = float(seed_gap["mean_abs"] if seed_gap is not None else 2 * s_sum["smoothed_noise_std"])
        runs.append(
            {
                **asdict(spec),
                "shared": {**s_sum, "rewards": mine},
                "alone": {**a_sum, "rewards": solo, "seconds": alone[f"alone_{spec.run_id}"].seconds},
                "gap_shared_vs_alone": gap,
                "noise_reference_mean_abs": noise_ref,
                "within_noise": bool(gap["mean_abs"] <= noise_ref),
            }
        )
        rows.append(
            [
                spec.run_id,
                f"{spec.lr:g}",
                spec.rank,
                "yes" if spec.well_configured else "no",
                f"{s_sum['first']:.3f}",
                f"{s_sum['final']:.3f} / {a_sum['final']:.3f}",
                f"{s_sum['rise']:+.3f} / {a_sum['rise']:+.3f}",
                "/".join("yes" if c["final_reached_target"] else "no" for c in (s_sum, a_sum)),
                f"{gap['mean_abs']:.3f} / {gap['max_abs']:.3f}",
                f"{noise_ref:.3f}",
            ]
        )
        colour = colours[i % len(colours)]
        steps = list(range(len(mine)))
        curves[f"{spec.run_id} shared"] = (steps, smooth(mine, window).tolist())
        styles[f"{spec.run_id} shared"] = {"color": colour, "linestyle": "-"}
        curves[f"{spec.run_id} alone"] = (list(range(len(solo))), smooth(solo, window).tolist())
        styles[f"{spec.run_id} alone"] = {"color": colour, "linestyle": "--"}
    if seed_check:
        first = specs[0].run_id
        other = alone[f"alone_{first}_seed{seed + 1}"].curves[first]
        label = f"{first} alone, seed {seed + 1}"
        curves[label] = (list(range(len(other))), smooth(other, window).tolist())
        styles[label] = {"color": "grey", "linestyle": ":"}
    png = plot_learning_curves(
        curves,
        RESULTS / f"{name}.png",
        # Settings on a line of their own: on the first they would run past the figure's edge.
        title=f"{len(specs)} runs in one trainer (solid) vs alone (dashed), '{budget.task}', smoothed over {window}"
        + (f"\n{budget.settings_label()}" if budget.settings_label() else ""),
        xlabel="run step",
        ylabel="mean reward",
        hline=target,
        styles=styles,
    )
    well = [r for r in runs if r["well_configured"]]
    environment = f"'{budget.task}' {budget.settings_label()}".rstrip()
    warmup_steps = model_settings(budget)["warmup_steps"]  # --model-json may override --warmup-steps
    figures: dict[str, Any] = {
        "budget": asdict(budget),
        "seed": seed,
        "window": window,
        "tail": tail,
        "target": target,
        "min_rise": min_rise,
        "base_model": model_settings(budget),
        "shared_seconds": shared.seconds,
        "alone_parallel": parallel,
        "seed_to_seed_gap": seed_gap,
        "runs": runs,
        "goal_all_well_configured_reach_target": all(r["shared"]["final_reached_target"] for r in well),
        "goal_all_within_noise": all(r["within_noise"] for r in runs),
        # The arithmetic goal: each well-configured run's reward rises, shared and alone.
        "goal_all_well_configured_rise": all(r[side]["rise"] >= min_rise for r in well for side in ("shared", "alone")),
        "png": str(png),
    }
    figures["json"] = str(
        report(
            name,
            f"{len(specs)} runs share one trainer vs alone, {environment}: {budget.steps} steps x "
            f"{budget.batch_size} samples, base warm-up {warmup_steps}; first/final = mean of first/last "
            f"{tail} steps; |d| over curves smoothed by {window}",
            [
                "run",
                "lr",
                "rank",
                "well",
                "first",
                "final sh/alone",
                "rise sh/alone",
                f">={target:g}",
                "|d| mean/max",
                "noise",
            ],
            rows,
            figures,
        )
    )
    print(f"wrote {png}")
    return figures


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny budget (a smoke test, not a learning result)")
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default=None, help="environment, base model, budget and runs"
    )
    # None = the preset's value, or Budget()'s without a preset: flags given override a preset.
    parser.add_argument("--task", default=None, help="environment name with its default settings")
    parser.add_argument(
        "--env-json", type=_json_object, default=None, help='environment with settings (replaces --task): {"name": ...}'
    )
    parser.add_argument(
        "--model-json", type=_json_object, default=None, help="TinyModelConfig settings of the base checkpoint"
    )
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--warmup-steps", type=int, default=None)
    parser.add_argument("--max-async-level", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=None, help="seconds per group of processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-seed-check", action="store_true", help="skip the second-seed run")
    parser.add_argument("--parallel", type=int, default=2, help="alone runs trained at once")
    parser.add_argument("--window", type=int, default=10, help="smoothing window (steps)")
    parser.add_argument("--target", type=float, default=None)
    parser.add_argument("--min-rise", type=float, default=0.2, help="goal: rise of each well-configured run")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the run directories here (default: temp)")
    args = parser.parse_args(argv)
    if args.env_json is not None and "name" not in args.env_json:
        parser.error('--env-json: the object needs a "name"')
    return args


@dataclass(frozen=True)
class Setup:
    budget: Budget
    specs: tuple[RunSpec, ...]
    options: dict[str, Any]  # run_benchmark's keyword arguments
    workdir: Path | None


def configure(argv: list[str] | None = None) -> Setup:
    """The command line resolved: flags given override the preset, the preset overrides `Budget()`."""
    args = parse_args(argv)
    preset = PRESETS[args.preset] if args.preset else Preset(Budget(), DEFAULT_SPECS, target=0.7)
    base = preset.budget

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    env = base.env
    if args.env_json is not None:
        env = args.env_json
    elif args.task is not None:
        env = None  # a task named on the command line replaces a preset's environment too
    budget = replace(
        base,
        task=str(env["name"]) if env is not None else pick(args.task, base.task),
        env=env,
        model=pick(args.model_json, base.model),
        steps=pick(args.steps, 6 if args.quick else base.steps),
        batch_size=16 if args.quick else pick(args.batch_size, base.batch_size),
        group_size=4 if args.quick else pick(args.group_size, base.group_size),
        warmup_steps=pick(args.warmup_steps, base.warmup_steps),
        max_async_level=pick(args.max_async_level, base.max_async_level),
        timeout_s=pick(args.timeout, base.timeout_s),
    )
    options: dict[str, Any] = {
        "seed": args.seed,
        "seed_check": not (args.no_seed_check or args.quick),
        "parallel": len(preset.specs) if args.quick else args.parallel,  # quick: two waves of processes
        "window": 2 if args.quick else args.window,
        "target": pick(args.target, preset.target),
        "min_rise": args.min_rise,
    }
    return Setup(budget, preset.specs, options, args.workdir)


def main(argv: list[str] | None = None) -> None:
    setup = configure(argv)
    if setup.workdir is not None:
        if setup.workdir.exists():
            sys.exit(f"--workdir {setup.workdir}: already exists (the run directories must start empty)")
        run_benchmark(setup.workdir, setup.specs, setup.budget, **setup.options)
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rlplex-mrlearn-") as tmp:
        run_benchmark(Path(tmp), setup.specs, setup.budget, **setup.options)


if __name__ == "__main__":
    main()
