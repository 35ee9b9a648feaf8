"""The main job from Python, as TRL users write a trainer: build it from objects, run it, read
its results. It builds the very `MainJobConfig` a TOML file loads into (the same validation,
the same one-line errors), so a job written either way is the same job.

    from rlplex.mainjob.api import main_job, run, run_job
    from my_reward import exact_number             # a module the job's processes can import

    job = main_job(
        "my-data", "outputs/my-data", model="outputs/models/smollm2-135m", trainer={"world_size": 1},
        runs=[run("run_mine", data=dataset, reward=exact_number, messages_field="messages",
                  max_steps=20, batch_size=16, group_size=4, optim={"lr": 3e-4})],
    )
    result = run_job(job)                         # a JobResult: outcome, each run's steps and rewards
    result.export("run_mine", "outputs/my-model", merge=True)

The job's processes import the reward by name (`module:function`), so it must be a function at
the top level of a module they can import: not a lambda, not a function of `__main__`. A
`datasets.Dataset` (or anything with `to_json`) given as `data` is written into the job's folder
(`data/<run id>.jsonl`), which the job then reads like a user's file and keeps for a resume.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from rlplex.config import validate_config
from rlplex.errors import ConfigError
from rlplex.mainjob.config import MainJobConfig, RunEntry

DATA_DIR = "data"


def reward_path(reward: str | Callable[..., float], field_name: str = "reward") -> str:
    """The `module:function` name the job's processes import `reward` by."""
    if isinstance(reward, str):
        return reward
    module, name = getattr(reward, "__module__", None), getattr(reward, "__qualname__", "")
    if not callable(reward) or not module or not name:
        raise ConfigError(f"field {field_name!r}: {reward!r} is neither a 'module:function' name nor a function")
    if module == "__main__" or "<" in name:  # <lambda>, <locals>
        raise ConfigError(
            f"field {field_name!r}: {module}.{name} cannot be imported by the job's processes; define it at the "
            "top level of a module (a file beside your script) and import it from there"
        )
    return f"{module}:{name}"


def run(
    run_id: str,
    *,
    env: str | Mapping[str, Any] | None = None,
    data: str | Path | Any = None,
    reward: str | Callable[..., float] | None = None,
    **settings: Any,
) -> RunEntry:
    """One run: `env` an environment's name or table (`{"name": "arithmetic", "steps": [1, 2]}`),
    or `data` (a JSONL or Parquet file, or a `datasets.Dataset`) scored by `reward`; `settings`
    are the run's other fields (`max_steps`, `batch_size`, `optim={"lr": ...}`, ...) and the
    data's (`messages_field`, `prompt_field`, `answer_field`, `max_new_tokens`, `shuffle`)."""
    data_fields = ("prompt_field", "messages_field", "answer_field", "max_new_tokens", "shuffle")
    own = {key: settings.pop(key) for key in data_fields if key in settings and data is not None}
    if data is not None:
        if env is not None:
            raise ConfigError(f"run {run_id!r}: give env or data, not both")
        if reward is None:
            raise ConfigError(f"run {run_id!r}: data needs a reward (a function or 'module:function')")
        is_parquet = isinstance(data, str | Path) and str(data).endswith(".parquet")
        path = str(data) if isinstance(data, Path) else data  # a dataset object stays until main_job writes it
        table: dict[str, Any] = {"name": "parquet" if is_parquet else "jsonl", "path": path, **own}
    elif env is None:
        raise ConfigError(f"run {run_id!r}: give env (an environment) or data (a file or a dataset)")
    else:
        table = {"name": env} if isinstance(env, str) else dict(env)
    if reward is not None:
        table["reward"] = reward_path(reward, f"run {run_id!r}: reward")
    return validate_config(RunEntry, {"id": run_id, "config": {"env": table, **settings}}, source=f"run {run_id!r}")


def _write_datasets(runs: Sequence[RunEntry], output_dir: Path) -> list[RunEntry]:
    """Each run whose data is a dataset object, with the dataset written to the job's folder."""
    written = []
    for entry in runs:
        env = entry.config.get("env", {})
        data = env.get("path") if isinstance(env, dict) else None
        if data is None or isinstance(data, str | Path):
            written.append(entry)
            continue
        if not callable(getattr(data, "to_json", None)):
            raise ConfigError(f"run {entry.id!r}: data {type(data).__name__} is not a path or a datasets.Dataset")
        path = output_dir / DATA_DIR / f"{entry.id}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        data.to_json(str(path), lines=True)
        config = {**entry.config, "env": {**env, "name": "jsonl", "path": str(path.resolve())}}
        written.append(entry.model_copy(update={"config": config}))
    return written


def main_job(
    name: str,
    output_dir: str | Path,
    *,
    model: str | Mapping[str, Any],
    runs: Sequence[RunEntry],
    later_runs: Sequence[RunEntry] = (),
    **fields: Any,
) -> MainJobConfig:
    """The job (`MainJobConfig`, what `rlplex run FILE` loads): `model` a hub id, a folder or a
    `[model]` table; `fields` the file's other tables (`trainer={"world_size": 1}`, `inference`,
    `logging`, `events`, `timeout_s` ...). Every run is checked here, as `rlplex check` would."""
    out = Path(output_dir)
    data = {
        "name": name,
        "output_dir": str(out),
        "model": {"name": model} if isinstance(model, str) else dict(model),
        "runs": [entry.model_dump() for entry in _write_datasets(runs, out)],
        "later_runs": [entry.model_dump() for entry in _write_datasets(later_runs, out)],
        **fields,
    }
    source = f"main_job({name!r})"
    config = validate_config(MainJobConfig, data, source=source)
    config.check_runs(source)
    return config


@dataclass(frozen=True)
class RunResult:
    run_id: str
    state: str  # finished, evicted, rejected, or where it stopped (running, waiting)
    trained_steps: int
    max_steps: int
    rewards: list[float]  # mean reward of each step, in order
    evaluations: list[dict[str, float]] = field(default_factory=list)  # held-out scores, by policy step
    reason: str = ""  # why it was evicted or rejected


@dataclass(frozen=True)
class JobResult:
    outcome: str  # FINISHED, STOPPED by ..., FAILED
    output_dir: Path
    runs: dict[str, RunResult]

    @property
    def report(self) -> Path:
        return self.output_dir / "report.md"

    def export(self, run_id: str, dest: str | Path, merge: bool = False, step: int | None = None) -> Path:
        """`rlplex export`: the run's newest (or step `step`'s) adapter, or merged model, at `dest`."""
        from rlplex.multirun.export import export_run

        return export_run(self.output_dir, run_id, Path(dest), merge=merge, step=step).dest


def job_result(output_dir: Path) -> JobResult:
    """What a main job's folder says of it now (a job that ran, or one still running)."""
    from rlplex.mainjob.view import collect

    view = collect(output_dir)
    runs = {
        run.run_id: RunResult(
            run.run_id,
            run.state,
            run.trained_steps,
            run.max_steps,
            [reward for _step, reward in run.curve],
            run.evaluations,
            run.reason,
        )
        for run in view.runs
    }
    return JobResult(view.outcome, output_dir, runs)


def run_job(config: MainJobConfig, *, console: Console | None = None, live: bool = False) -> JobResult:
    """Run the job to its end (a line per run as it changes; `live`: the terminal view) and return
    its results. A job that fails raises as `rlplex run` fails (`JobFailedError` and the like)."""
    from rlplex.mainjob.driver import run_main_job

    run_main_job(config, console or Console(), live=live, source=f"job {config.name!r}")
    return job_result(config.output_dir.resolve())


__all__ = ["JobResult", "RunResult", "job_result", "main_job", "reward_path", "run", "run_job"]
