"""Every example in examples/ runs (with a tiny budget) or at least loads, and the CLI's help
and user errors behave as the README says.

The self-loop pipeline job (examples/selfloop_job.toml, its stages in
examples/selfloop_pipeline.py) is run end to end by tests/control/test_channel_selfloop.py; the
main job (examples/multirun_demo.toml) is run end to end, with its own tiny config, by
tests/mainjob/test_main_job_e2e.py. Here those two are only loaded. Every command README.md
shows is run as written (tiny budgets) by tests/test_readme_commands.py.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from cli_helpers import rlplex_in_process
from rlplex.cli import app
from rlplex.cli_mainjob import check_file_kind
from rlplex.config import FILE_KINDS
from rlplex.control.job.spec import load_job
from rlplex.errors import ConfigError
from rlplex.mainjob.config import load_main_job
from rlplex.multirun.orchestrator.config import read_orch_config
from rlplex.runners.config import load_train_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def child_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    # Rich wraps at $COLUMNS (80 when unset and not a terminal): leave it unset, as in a script.
    env.pop("COLUMNS", None)
    return env


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout
    )


def train(*args: str) -> subprocess.CompletedProcess[str]:
    """`rlplex train ARGS` in this process; the real entry point trains in
    test_cartpole_example_trains_through_the_cli and in tests/test_readme_commands.py."""
    return rlplex_in_process("train", *args)


def read_csv(path: Path) -> list[dict[str, float]]:
    with path.open(newline="") as handle:
        return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(handle)]


# ----- a runner on CartPole ------------------------------------------------------------------
@pytest.mark.slow
def test_cartpole_example_trains_through_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "cp"
    done = run("-m", "rlplex.cli", "train", "examples/cartpole_ppo.toml", "--output", str(out),
               "--n-steps", "512", "--no-progress")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = read_csv(out / "progress.csv")
    assert rows and rows[-1]["charts/env_steps"] == 512  # the flag's budget, not the file's 200 000
    assert "charts/eval_return_mean" in rows[-1]
    assert (out / "learning_curve.png").read_bytes()[:8] == PNG_MAGIC
    used = json.loads((out / "config.json").read_text())
    assert used["runner"]["n_steps"] == 512 and used["algo"]["n_epochs"] == 20  # flag over file, rest from file


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "algo", "n_steps"),
    # SAC's 150 steps pass its learning_starts (100), so its updates run; TD3/DDPG's 10k random
    # steps are not reached in a tiny budget (their updates are tested in tests/test_sac_td3.py).
    # The DQNs' 1024 steps pass their learning_starts (1000): one batch of updates runs.
    [("pendulum_sac.toml", "sac", 150), ("pendulum_td3.toml", "td3", 200), ("pendulum_ddpg.toml", "ddpg", 200),
     ("cartpole_a2c.toml", "a2c", 400), ("cartpole_dqn_full.toml", "dqn", 1024), ("cartpole_c51.toml", "dqn", 1024),
     ("cartpole_novel_ppo_lstm.toml", "ppo", 512), ("cartpole_novel_r2d1.toml", "r2d1", 2100)],
)  # fmt: skip
def test_classic_example_trains_through_the_cli(name: str, algo: str, n_steps: int, tmp_path: Path) -> None:
    out = tmp_path / algo
    done = train(str(EXAMPLES / name), "--output", str(out), "--n-steps", str(n_steps), "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = read_csv(out / "progress.csv")
    assert rows and rows[-1]["charts/env_steps"] == n_steps and "charts/eval_return_mean" in rows[-1]
    assert json.loads((out / "config.json").read_text())["algo"]["name"] == algo
    if algo in ("sac", "a2c", "dqn", "ppo", "r2d1"):
        assert {"losses/actor", "losses/policy", "losses/td"} & set(rows[-1]), rows[-1]
    assert (out / "snapshots").is_dir() and (out / "learning_curve.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_mujoco_example_trains_through_the_cli(tmp_path: Path) -> None:
    """HalfCheetah-v5 (float64 observations, a 6-dim Box action) through `rlplex train`: the
    example as written but for learning_starts (10k there), so that SAC's updates run."""
    config = tmp_path / "halfcheetah_sac.toml"
    text = (EXAMPLES / "halfcheetah_sac.toml").read_text()
    assert "learning_starts = 10_000" in text
    config.write_text(text.replace("learning_starts = 10_000", "learning_starts = 200"))
    out = tmp_path / "hc"
    done = train(str(config), "--output", str(out), "--n-steps", "400", "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = read_csv(out / "progress.csv")
    last = rows[-1]
    assert last["charts/env_steps"] == 400 and last["charts/eval_length_mean"] == 1000  # HalfCheetah never ends early
    assert math.isfinite(last["losses/actor"]) and math.isfinite(last["losses/critic"]), last
    assert json.loads((out / "config.json").read_text())["env"]["id"] == "HalfCheetah-v5"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "n_steps", "edits"),
    # Games cut to 400 frames (100 agent steps) so that evaluation's whole games end quickly; the
    # DQN's 100k learning starts lowered so that its updates run in the tiny budget; PPO's
    # environments stepped in this process, 16 steps each (two workers starting torch cost most of a
    # minute on a busy 2-core machine; the parallel sampler on Atari is tested in tests/test_atari.py).
    [
        ("pong_ppo.toml", 128, {'kind = "parallel"': 'kind = "serial"', "batch_T = 128": "batch_T = 16"}),
        ("pong_dqn.toml", 128, {"learning_starts = 100_000": "learning_starts = 64"}),
    ],
)
def test_atari_example_trains_through_the_cli(name: str, n_steps: int, edits: dict[str, str], tmp_path: Path) -> None:
    text = (EXAMPLES / name).read_text()
    edits = {'id = "ALE/Pong-v5"': 'id = "ALE/Pong-v5"\nkwargs = { max_num_frames_per_episode = 400 }', **edits}
    for old, new in edits.items():
        assert old in text, old
        text = text.replace(old, new)
    config, out = tmp_path / name, tmp_path / "out"
    config.write_text(text)
    done = train(str(config), "--output", str(out), "--n-steps", str(n_steps), "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = read_csv(out / "progress.csv")
    assert rows and rows[-1]["charts/env_steps"] == n_steps
    losses = [value for key, value in rows[-1].items() if key in ("losses/td", "losses/policy", "losses/value")]
    assert losses and all(math.isfinite(value) for value in losses), rows[-1]
    # Evaluation plays Pong with the game's own scores: each point is -1 or +1, unclipped.
    assert -21 <= rows[-1]["charts/eval_return_mean"] <= 21
    assert (out / "snapshots").is_dir()


# ----- the seed's PPO dataflow graph -------------------------------------------------------
def test_ppo_dataflow_uses_the_tiny_model_make_demo_left_whatever_its_warm_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32, hole 3: after `make demo` (tiny-reverse warmed up 110 steps), the example no
    longer stops on "holds other settings ... --replace" (a flag it does not have)."""
    import importlib.util
    import shutil

    from lm_models import small_tiny_model

    folder = tmp_path / "outputs" / "models" / "tiny-reverse"
    shutil.copytree(small_tiny_model(), folder)
    marker = folder / "rlplex_tiny.json"
    held = json.loads(marker.read_text())
    held["settings"]["warmup_steps"], held["key"] = 110, "other-settings"
    marker.write_text(json.dumps(held))
    spec = importlib.util.spec_from_file_location("ppo_dataflow_example", EXAMPLES / "ppo_dataflow.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.chdir(tmp_path)
    assert example.tiny_model_for("reverse") == folder.resolve()
    assert json.loads(marker.read_text()) == held  # used as it is, not rebuilt


@pytest.mark.slow
def test_ppo_dataflow_example_runs_the_four_mfcs(tmp_path: Path) -> None:
    out = tmp_path / "ppo"
    from lm_models import small_tiny_model

    done = run("examples/ppo_dataflow.py", "--steps", "2", "--batch-size", "8", "--model", str(small_tiny_model()),
               "--output-dir", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = read_csv(out / "progress.csv")
    assert [row["step"] for row in rows] == [1, 2]
    assert [row["charts/policy_version"] for row in rows] == [1, 2]  # actor_train ran once per step
    for row in rows:
        assert 0.0 <= row["charts/reward_mean"] <= 1.0
        for mfc in ("actor_gen", "ref_inf", "rew_inf", "actor_train"):
            assert row[f"timings/{mfc}_run_s"] > 0, mfc
    # The reference is a frozen copy: equal to the actor before the first update, apart after it.
    assert rows[0]["losses/kl_to_ref"] == pytest.approx(0.0, abs=1e-6)
    assert rows[1]["losses/kl_to_ref"] > 1e-6
    table = [line.split() for line in done.stdout.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert len(table) == 2 and all(len(line) == 8 for line in table), done.stdout  # step, reward, kl, 4 MFCs, total
    assert (out / "learning_curve.png").read_bytes()[:8] == PNG_MAGIC


# ----- every example file loads with its loader --------------------------------------------
def _load_job(path: Path) -> Any:
    spec = load_job(path)
    for name, role in spec.roles.items():  # scripts the roles run are part of the example too
        script = role.config.get("script")
        assert script is None or (ROOT / script).is_file(), f"{path.name}: role {name!r}: no script {script!r}"
    return spec


LOADERS: dict[str, tuple[str, Callable[[Path], Any]]] = {  # file: (kind for the CLI, loader)
    "cartpole_ppo.toml": ("train", load_train_config),  # rlplex train
    "pendulum_ppo.toml": ("train", load_train_config),
    "pendulum_sac.toml": ("train", load_train_config),
    "halfcheetah_sac.toml": ("train", load_train_config),
    "pendulum_td3.toml": ("train", load_train_config),
    "pendulum_ddpg.toml": ("train", load_train_config),
    "cartpole_a2c.toml": ("train", load_train_config),
    "cartpole_dqn_full.toml": ("train", load_train_config),
    "cartpole_c51.toml": ("train", load_train_config),
    "cartpole_novel_ppo_lstm.toml": ("train", load_train_config),
    "cartpole_novel_r2d1.toml": ("train", load_train_config),
    "pong_dqn.toml": ("train", load_train_config),
    "pong_ppo.toml": ("train", load_train_config),
    "job_noop.toml": ("job", _load_job),  # rlplex job run
    "elastic_job.toml": ("job", _load_job),
    "selfloop_job.toml": ("job", _load_job),
    "multirun_demo.toml": ("main", load_main_job),  # rlplex run (checks every run's orchestrator config too)
    "smollm2_arithmetic.toml": ("main", load_main_job),  # make demo-real
    "my_data/job.toml": ("main", load_main_job),  # the README's quickstart
    "multirun_orch.toml": ("orch", read_orch_config),  # rlplex runs add --config, or an orchestrator's orch.toml
    "models/qwen2.5-0.5b.toml": ("main", load_main_job),  # a real model on a GPU box
}


def test_every_example_config_has_a_loader() -> None:
    found = sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.toml"))
    assert found == sorted(LOADERS), "add the new example to LOADERS"


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_example_config_loads(name: str) -> None:
    kind, loader = LOADERS[name]
    path = EXAMPLES / name
    check_file_kind(path, kind)  # what the CLI checks before loading
    assert loader(path) is not None
    for other in set(FILE_KINDS) - {kind}:  # ... and given to the wrong command, it names the right one
        with pytest.raises(ConfigError, match=f"this is {FILE_KINDS[kind][1]}"):
            check_file_kind(path, other)


def test_the_real_model_example_validates_without_downloading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlplex.errors import ModelLoadError
    from rlplex.mainjob.driver import check_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    config = load_main_job(EXAMPLES / "models" / "qwen2.5-0.5b.toml")
    assert config.model.name == "Qwen/Qwen2.5-0.5B-Instruct"
    runs = [entry.orch_config("example") for entry in config.runs]
    assert {run.model.name for run in runs} == {"Qwen/Qwen2.5-0.5B-Instruct"} and len(runs) == 3
    assert {run.env.name for run in runs} == {"arithmetic"}
    assert max(run.model.lora.rank for run in runs) <= config.trainer.max_lora_rank
    # Before any process starts, `rlplex run` checks the model; offline and uncached, it says so.
    with pytest.raises(ModelLoadError, match=r"'Qwen/Qwen2\.5-0\.5B-Instruct'.*not in the Hugging Face cache"):
        check_model(config)


def test_the_smollm2_example_trains_three_learning_rates_scored_on_held_out_problems() -> None:
    from rlplex.inference.config import resolve_engine

    config = load_main_job(EXAMPLES / "smollm2_arithmetic.toml")
    runs = [entry.orch_config("example") for entry in config.runs]
    assert len({run.optim.lr for run in runs}) == 3 and config.trainer.max_runs == 3
    assert config.model.name.endswith("outputs/models/smollm2-135m")  # what `make demo-real` converts into
    assert config.inference.engine == resolve_engine("auto")
    for run in runs:
        assert run.evaluation is not None and run.env.model_extra and run.env.model_extra["split"] == "train"
        assert run.evaluation.env_spec(run.env).model_extra == {**run.env.model_extra, "split": "heldout"}


def test_every_example_script_is_run_by_a_test() -> None:
    """ppo_dataflow.py is run above, selfloop_pipeline.py by tests/control/test_channel_selfloop.py,
    elastic_train.py by tests/control/test_elastic.py: a new script needs a test of its own."""
    tests = [p.read_text() for p in (ROOT / "tests").rglob("test_*.py") if p.name != "test_examples.py"]
    tests.append(Path(__file__).read_text().split("def test_every_example_script_is_run_by_a_test")[0])
    for script in sorted(EXAMPLES.rglob("*.py")):
        name = str(script.relative_to(EXAMPLES))
        assert any(name in text for text in tests), f"examples/{name} is run by no test"


# ----- the CLI ------------------------------------------------------------------------------
def command_paths(command: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and group under `command` (typer vendors its own click: duck-typed, not isinstance)."""
    paths = [prefix]
    for name, sub in getattr(command, "commands", {}).items():
        paths.extend(command_paths(sub, (*prefix, name)))
    return paths


def test_help_for_every_command() -> None:
    paths = command_paths(typer.main.get_command(app))
    expected = {("train",), ("run",), ("status",), ("job", "run"), ("job", "resume"), ("job", "status"),
                ("runs", "add"), ("runs", "evict")}  # fmt: skip
    assert expected <= set(paths), paths
    runner = CliRunner()
    for path in paths:
        result = runner.invoke(app, [*path, "--help"])
        assert result.exit_code == 0, (path, result.output)
        assert "Usage:" in result.output and "--help" in result.output, (path, result.output)
    done = run("-m", "rlplex.cli", "--help", timeout=60)  # the real entry point, once
    assert done.returncode == 0 and "Usage:" in done.stdout and "train" in done.stdout


def test_user_errors_print_one_line_without_traceback(tmp_path: Path) -> None:
    """Commands tests/test_cli.py and tests/control/test_failover.py do not cover; in process
    (the same typer app; a subprocess per case costs seconds of torch import on two cores)."""
    missing = tmp_path / "a_rather_long_folder_name_so_that_the_message_is_wider_than_eighty_columns"
    bad_job = tmp_path / "bad_job.toml"
    bad_job.write_text(EXAMPLES.joinpath("multirun_demo.toml").read_text().replace("world_size = 2", "world_size = 0"))
    markup = tmp_path / "markup.toml"
    markup.write_text('[env]\nid = "[red]NoSuchEnv-v0"\n')
    cases = [
        (("train", str(missing / "c.toml")), "config file not found"),
        (("train", str(markup), "--output", str(tmp_path / "o")), "[red]NoSuchEnv-v0"),  # not eaten as markup
        (("run", str(missing / "job.toml")), "config file not found"),
        (("run", str(bad_job)), "field 'trainer.world_size'"),
        (("status", str(missing)), "no such job folder"),
        (("runs", "add", str(missing), "--config", "examples/multirun_orch.toml"), "no main job here"),
        (("runs", "evict", str(tmp_path), "run_x", "--reason", "test"), "no such run"),
        # a file of another kind: its kind and command, not a list of every field it lacks
        (("train", "examples/multirun_demo.toml"), "this is a main job, not a runner's train config; run it with"),
        (("run", "examples/cartpole_ppo.toml"), "this is a runner's train config, not a main job"),
        (("job", "run", "examples/multirun_demo.toml"), "run it with `rlplex run FILE`"),
        (("runs", "add", str(tmp_path), "--config", "examples/elastic_job.toml"), "this is a control-plane job"),
    ]
    runner = CliRunner()
    for args, expected in cases:
        result = runner.invoke(app, list(args))
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2, (args, result.output, result.exception)
        assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], (args, result.output)
        assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output, args
    debug = runner.invoke(app, ["run", str(bad_job), "--debug"])
    assert type(debug.exception).__name__ == "ConfigError" and "trainer.world_size" in str(debug.exception)


def test_user_error_from_the_real_entry_point_is_one_line_at_80_columns(tmp_path: Path) -> None:
    missing = tmp_path / "a_rather_long_folder_name_so_that_the_message_is_wider_than_eighty_columns" / "c.toml"
    done = run("-m", "rlplex.cli", "train", str(missing), timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == f"error: {missing}: config file not found\n" and done.stderr == ""
