"""Issue 18, the main job as a user meets it: what the files already show is refused before
anything starts. The rest of issue 18 runs inside shared jobs: a run the trainer rejects ends
alone in tests/mainjob/test_main_job_e2e.py; a job stopped by SIGTERM or SIGHUP writes its
report, leaves no process and continues without training any step twice in
tests/mainjob/test_main_job_faults.py; `rlplex stop`, `rlplex resume` and `rlplex run --continue`
in tests/test_readme_commands.py::test_main_job_commands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mainjob_helpers import BATCH, run_config, tiny_job

from cli_helpers import rlplex_in_process
from rlplex.mainjob.config import load_main_job
from rlplex.mainjob.preflight import model_shape
from rlplex.models.spec import ModelSpec

pytestmark = pytest.mark.slow  # a CLI subprocess; no job starts

COMMAND = [sys.executable, "-m", "rlplex.cli"]


def test_rlplex_run_reports_every_problem_the_files_show_before_anything_starts(tmp_path: Path) -> None:
    from lm_models import random_llama

    out = tmp_path / "out"
    path = tmp_path / "job.toml"
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "12 + 30 =", "answer": "42"}\n')
    runs = {
        # Issue 32, hole 2: mistakes inside a run's environment, found before anything starts.
        "run_typo": run_config(4, 2, "").replace(
            'env = { name = "reverse" }',
            f'env = {{ name = "jsonl", path = "{data}", reward = "rlplex.tasks.rewards:exact_matchh" }}',
        ),
        "run_nodata": run_config(5, 2, "").replace(
            'env = { name = "reverse" }',
            f'env = {{ name = "jsonl", path = "{tmp_path}/nope.jsonl", reward = "rlplex.tasks.rewards:exact_match" }}',
        ),
        "run_wide": run_config(1, 2, "model = { lora = { rank = 16 } }"),
        "run_other": run_config(2, 2, f'model = {{ name = "{random_llama()}" }}'),
        "run_huge": run_config(3, 2).replace(f"batch_size = {BATCH}", "batch_size = 4000000000"),
    }
    path.write_text(
        tiny_job("mj-preflight", out, runs, trainer="max_lora_rank = 8").replace("max_runs = 4", "max_runs = 100000000")
    )
    done = subprocess.run([*COMMAND, "run", str(path), "--no-live"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    errors = [line for line in done.stdout.splitlines() if line.startswith("error:")]
    expected = {
        "run_typo": "exact_matchh",
        "run_nodata": "nope.jsonl: data file not found",
        "run_wide": "model.lora.rank",
        "run_other": "model.name",
        "run_huge": "batch_size",
        "trainer.max_runs": "adapter slots",
    }
    for key, field in expected.items():
        assert any(key in line and field in line for line in errors), (key, done.stdout)
    assert len(errors) == len(expected), done.stdout
    assert not (out / "job.sqlite").exists()  # nothing was started
    # `rlplex check` finds the same, and starts nothing either.
    checked = rlplex_in_process("check", str(path))
    assert checked.returncode == 2 and "Traceback" not in checked.stdout + checked.stderr
    assert [line for line in checked.stdout.splitlines() if line.startswith("error:")] == errors
    assert not out.exists()


def test_the_checks_before_a_job_of_a_local_model_import_neither_torch_nor_the_auto_classes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rlplex check` and `rlplex run`'s checks before any process starts read a local folder's
    tokenizer.json and config.json without torch (about 5 s of a check's 6 s before): the
    numbers they check are the same (the memory bounds read the same fields)."""
    path = tmp_path / "job.toml"
    path.write_text(tiny_job("mj-light", tmp_path / "out", {"run_a": run_config(1, 2)}))
    code = (
        "import sys\n"
        "from rlplex.mainjob.config import load_main_job\n"
        "from rlplex.mainjob.driver import preflight\n"
        "from rlplex.mainjob.preflight import model_shape\n"
        f"job = load_main_job({str(path)!r})\n"
        f"preflight(job, {str(path)!r})\n"
        "print(model_shape(job.model))\n"
        "print(' '.join(m for m in ('torch', 'transformers.models.auto.modeling_auto') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    shape, imported = done.stdout.splitlines()
    assert imported == "", f"imported by the checks: {imported}"
    # The same shape as `AutoConfig` gives, the path of a folder whose config.json lacks the fields.
    monkeypatch.setattr(ModelSpec, "local_config", lambda spec: None)
    assert shape == str(model_shape(load_main_job(path).model))


def test_rlplex_check_passes_a_good_file_and_starts_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    path = tmp_path / "job.toml"
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "12 + 30 =", "answer": "42"}\n')
    env = f'env = {{ name = "jsonl", path = "{data}", reward = "rlplex.tasks.rewards:exact_match" }}'
    path.write_text(tiny_job("mj-check", out, {"run_a": run_config(1, 2).replace('env = { name = "reverse" }', env)}))
    checked = rlplex_in_process("check", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{path}: ok: 1 run(s) on " in checked.stdout and "nothing was started" in checked.stdout
    assert not out.exists()
