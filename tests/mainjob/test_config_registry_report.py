"""The main job's files: config validation, the run registry and requests, the view and the report."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from rlplex.errors import ConfigError, RunConfigError, WaitTimeoutError
from rlplex.mainjob.config import INFERENCE_DIR, MainJobConfig, RunEntry, load_main_job
from rlplex.mainjob.frame import render
from rlplex.mainjob.registry import (
    answer,
    pending_requests,
    read_registry,
    rollout_ranks,
    rollout_slots,
    run_for_rank,
    submit_add,
    wait_for_answer,
    write_registry,
)
from rlplex.mainjob.report import REPORT_FILE, write_report
from rlplex.mainjob.view import collect
from rlplex.multirun.rundir import STABLE_MARKER, RunDir, write_finished

RUN = {"env": {"name": "reverse"}, "max_steps": 4, "batch_size": 8, "model": {"name": "m"}}

JOB = """
name = "mj"
output_dir = "{out}"
[model]
name = "m"
[trainer]
world_size = 2
[[runs]]
id = "run_a"
config = {{ env = {{ name = "reverse" }}, max_steps = 4, batch_size = 8 }}
[[later_runs]]
id = "run_late"
config = {{ env = {{ name = "reverse" }}, max_steps = 2, batch_size = 8 }}
[[events]]
when = {{ run = "run_a", step = 2 }}
add_run = "run_late"
"""


def write_job(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text.format(out=tmp_path / "out"))
    return path


def test_a_valid_job_loads_and_knows_its_runs_folder(tmp_path: Path) -> None:
    config = load_main_job(write_job(tmp_path, JOB))
    assert [r.id for r in config.runs] == ["run_a"] and config.events[0].add_run == "run_late"
    assert config.runs_dir == tmp_path / "out" / "runs"


def test_an_output_folder_given_on_the_command_line_is_where_every_run_finds_its_engine(tmp_path: Path) -> None:
    """`rlplex run FILE --output OTHER` once gave the job OTHER but left each run's inference
    endpoint (the API key's folder) under the file's output_dir: every orchestrator failed."""
    path = write_job(tmp_path, JOB.replace("[trainer]", '[inference]\nengine = "vllm"\n\n[trainer]', 1))
    other = tmp_path / "other"
    config = load_main_job(path, {"output_dir": str(other)})
    assert config.output_dir == other and config.endpoint_dir == other / INFERENCE_DIR
    for entry in config.runs + config.later_runs:
        assert entry.orch_config("job").inference.endpoint_dir == str((other / INFERENCE_DIR).resolve())


def test_engine_auto_is_vllm_on_a_cuda_gpu_with_vllm_and_hf_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rlplex.inference.config as inference_config
    import rlplex.inference.vllm_server as vllm_server
    from rlplex.inference.config import resolve_engine

    assert (resolve_engine("hf"), resolve_engine("vllm")) == ("hf", "vllm")  # a choice is kept
    for gpu, build, device, engine in (
        (True, "gpu", "auto", "vllm"),
        (True, "gpu", "cpu", "hf"),  # the model is held on the CPU
        (True, "cpu", "auto", "hf"),  # only vLLM's CPU build
        (False, "cpu", "auto", "hf"),  # a CPU machine: in process (measured faster at these sizes)
        (False, None, "auto", "hf"),
    ):
        monkeypatch.setattr(inference_config, "cuda_present", lambda gpu=gpu: gpu)
        monkeypatch.setattr(vllm_server, "vllm_build", lambda build=build: build)
        assert resolve_engine("auto", device) == engine, (gpu, build, device)
        # The job (its model on device "auto") resolves it once: its runs get the concrete engine.
        if device != "auto":
            continue
        config = load_main_job(write_job(tmp_path, JOB))
        assert config.inference.engine == engine and config.runs[0].orch_config("job").inference.engine == engine


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('add_run = "run_late"', 'add_run = "run_nope"', "events[0].add_run: 'run_nope' is not in later_runs"),
        ('id = "run_a"', 'id = "a/../b"', "runs.0.id"),
        ("world_size = 2", "world_size = 0", "trainer.world_size"),
        ("max_steps = 4,", "max_steps = -1,", "run 'run_a': config"),
        ('when = {{ run = "run_a", step = 2 }}', 'when = {{ run = "run_x", step = 2 }}', "when.run: no run 'run_x'"),
    ],
)
def test_a_bad_job_names_the_field(tmp_path: Path, old: str, new: str, message: str) -> None:
    assert old in JOB
    with pytest.raises((ConfigError, RunConfigError)) as caught:
        load_main_job(write_job(tmp_path, JOB.replace(old, new)))
    assert message in str(caught.value) and "job.toml" in str(caught.value)


def test_registry_maps_ranks_to_runs_and_requests_get_answers(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no main job here"):
        submit_add(tmp_path, RunEntry(id="run_b", config=RUN))
    write_registry(tmp_path, [RunEntry(id="run_a", config=RUN)])
    assert run_for_rank(tmp_path, 0).id == "run_a"
    with pytest.raises(ConfigError, match="no run for orchestrator rank 1"):
        run_for_rank(tmp_path, 1)
    good = submit_add(tmp_path, RunEntry(id="run_b", config=RUN))
    (tmp_path / "requests" / "add-9-bad.json").write_text("{not json")
    found = pending_requests(tmp_path)
    assert len(found) == 2
    request, broken = found
    assert not isinstance(request, tuple) and request.entry.id == "run_b"
    assert isinstance(broken, tuple) and "malformed request" in broken[1]
    answer(good, True, "run_b is orchestrator rank 1")
    assert wait_for_answer(good, timeout_s=1.0) == (True, "run_b is orchestrator rank 1")
    assert not good.exists()
    with pytest.raises(WaitTimeoutError, match="no answer"):
        wait_for_answer(tmp_path / "requests" / "add-9-bad.json", timeout_s=0.2)
    (tmp_path / "runs.json").write_text("{}")
    with pytest.raises(ConfigError, match="expected a JSON list"):
        read_registry(tmp_path)


def test_rollout_nodes_are_numbered_in_the_order_runs_join_and_the_job_has_a_role_for_them(tmp_path: Path) -> None:
    from rlplex.mainjob.build import ROLLOUT_ROLE, build_job_spec

    entries = [
        RunEntry(id="run_a", config=RUN | {"rollout_workers": 2}),
        RunEntry(id="run_b", config=RUN),  # generates in its orchestrator's process
        RunEntry(id="run_c", config=RUN | {"rollout_workers": 3}),
    ]
    assert rollout_slots(entries) == ["run_a", "run_a", "run_c", "run_c", "run_c"]
    write_registry(tmp_path, entries)
    assert rollout_ranks(tmp_path, "run_c") == [2, 3, 4] and rollout_ranks(tmp_path, "run_b") == []
    # A run joining later appends its nodes: the ranks of the runs already there do not move.
    write_registry(tmp_path, [*entries, RunEntry(id="run_d", config=RUN | {"rollout_workers": 2})])
    assert rollout_ranks(tmp_path, "run_c") == [2, 3, 4] and rollout_ranks(tmp_path, "run_d") == [5, 6]
    job = MainJobConfig.model_validate(
        {"name": "mj", "output_dir": str(tmp_path), "model": {"name": "m"}, "runs": [e.model_dump() for e in entries]}
    )
    roles = build_job_spec(job).roles
    assert roles[ROLLOUT_ROLE].count == 5 and roles["orchestrator"].count == 3
    assert roles[ROLLOUT_ROLE].entrypoint == "rlplex.mainjob.rollout_node:RolloutNode"


def fake_run(runs_dir: Path, run_id: str, trained: int, rewards: list[float]) -> RunDir:
    (runs_dir / run_id).mkdir(parents=True)
    run = RunDir(runs_dir, run_id)
    for step in range(trained + 1):
        directory = run.ensure_dir("broadcast", f"step_{step}")
        (directory / STABLE_MARKER).write_text("")
    lines = ["step,reward_mean,tokens_per_s"] + [f"{i},{r},{100 + i}" for i, r in enumerate(rewards)]
    (run.root / "progress.csv").write_text("\n".join(lines) + "\n7,0.9")  # a torn last line
    return run


def test_view_and_report_show_each_runs_state_rise_and_curves(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    names = ("run_done", "run_mid", "run_evicted", "run_waiting", "run_ending")
    write_registry(tmp_path, [RunEntry(id=i, config=RUN) for i in names])
    write_finished(fake_run(runs, "run_done", 4, [0.2, 0.3, 0.5, 0.7]), 4)
    fake_run(runs, "run_ending", 4, [0.1])  # last broadcast out, not yet marked finished by the trainer
    fake_run(runs, "run_mid", 2, [0.4, 0.5])
    evicted = fake_run(runs, "run_evicted", 1, [0.1])
    evicted.write_text(evicted.evicted, "bad rollouts: rewards holds NaN\n")
    (runs / "run_waiting").mkdir()
    view = collect(tmp_path)
    states = {run.run_id: (run.state, run.trained_steps) for run in view.runs}
    assert states == {"run_done": ("finished", 4), "run_mid": ("running", 2), "run_evicted": ("evicted", 1),
                      "run_waiting": ("waiting", 0), "run_ending": ("running", 4)}  # fmt: skip
    assert view.runs[0].reward == 0.7 and view.runs[0].tokens_per_s == 103
    done = view.runs[0]
    assert done.reward_start == pytest.approx(0.25) and done.reward_end == pytest.approx(0.6)
    assert done.reward_rise == pytest.approx((0.5 + 0.7) / 2 - (0.2 + 0.3) / 2)
    console = Console(record=True, width=80, height=24, file=io.StringIO())
    console.print(render(view, live=True))  # renders without a store
    drawn = console.export_text().splitlines()
    assert drawn[0].startswith("job UNKNOWN · elapsed — · ETA —") and len(drawn) <= 24
    assert "note: run_evicted evicted: bad rollouts: rewards holds NaN" in drawn
    report = write_report(tmp_path, fallback_wall_time_s=12.5)
    text = report.read_text()
    assert report.name == REPORT_FILE
    for section in (
        "## Runs",
        "## Learning curves",
        "## Nodes and restarts",
        "## Evictions",
        "Wall time: 12.5 s",
        "Trainer throughput: 0 tokens/s",
    ):
        assert section in text, section
    # No identity file, no trainer log: no wall time, no pace.
    assert "| run_done | finished | 4/4 | 0.250 | 0.600 | +0.350 | 103 | — | - |" in text
    assert "run_evicted: bad rollouts: rewards holds NaN" in text
    for png in ("rewards.png", "run_done.png", "run_mid.png"):
        assert (tmp_path / "plots" / png).stat().st_size > 1000
    # TensorBoard is written while the job runs, by each run's trackers, not by the report.
    assert "smoothed (weight 0.6)" in text and not (tmp_path / "tb").exists()


def test_trainer_throughput_sums_the_runs_newest_token_increments(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    write_registry(tmp_path, [RunEntry(id=i, config=RUN) for i in ("run_a", "run_b", "run_c")])
    logs = {
        # 100 tokens/s for run_a in its newest 30 s, 50 for run_b; run_c only before the window.
        "run_a": [(1000.0, 0), (1040.0, 1000), (1070.0, 4000)],
        "run_b": [(1040.0, 500), (1070.0, 2000)],
        "run_c": [(1000.0, 300)],
    }
    for run_id, rows in logs.items():
        run = fake_run(runs, run_id, 1, [0.5])
        directory = run.ensure_dir("logs")
        lines = ["step,total_tokens,time"] + [f"{i + 1},{tokens},{t}" for i, (t, tokens) in enumerate(rows)]
        (directory / "trainer_progress.csv").write_text("\n".join(lines) + "\n")
    view = collect(tmp_path)
    assert view.trained_tokens == 4000 + 2000 + 300
    assert view.trainer_tokens_per_s(window_s=30.0) == pytest.approx((3000 + 1500) / 30.0)
    assert view.trainer_tokens_per_s(window_s=100.0) == pytest.approx((4000 + 1500) / 70.0)
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(render(view))
    assert "trainer: 150 tokens/s (last 30 s), 6300 tokens trained" in console.export_text()


def test_job_config_model_refuses_duplicate_ids() -> None:
    with pytest.raises(ValueError, match="repeated"):
        MainJobConfig.model_validate(
            {
                "name": "x",
                "output_dir": "o",
                "model": {"name": "m"},
                "runs": [{"id": "run_a", "config": RUN}, {"id": "run_a", "config": RUN}],
            }
        )


def test_runs_take_the_job_model_and_a_local_folder_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    text = JOB.replace('name = "m"', 'name = "models/tiny"\ndtype = "float32"')
    config = load_main_job(write_job(tmp_path, text))
    absolute = str(tmp_path / "models" / "tiny")
    assert config.model.name == absolute
    for entry in [*config.runs, *config.later_runs]:
        orch = entry.orch_config("job")
        assert (orch.model.name, orch.model.dtype) == (absolute, "float32")
    # A run may name its own model: the trainer (not the loader) rejects it if it differs.
    other = RunEntry(id="run_x", config={**RUN, "model": {"name": "org/other", "lora": {"rank": 2}}})
    assert other.with_model(config.model).orch_config("x").model.name == "org/other"


def test_trainer_settings_reach_the_trainer_as_one_json_of_its_config_and_the_preflight(tmp_path: Path) -> None:
    from rlplex.mainjob.build import build_job_spec, trainer_config
    from rlplex.mainjob.preflight import run_problems
    from rlplex.multirun.trainer.config import TrainerConfig

    settings = "world_size = 2\nmax_off_policy_steps = 1\nretention = {{ checkpoints = {{ keep_last = 2 }} }}"
    settings += '\ntarget_modules = ["q_proj", "v_proj", "lm_head"]'
    config = load_main_job(write_job(tmp_path, JOB.replace("world_size = 2", settings)))
    trainer = trainer_config(config)
    assert trainer.max_off_policy_steps == 1 and trainer.retention.checkpoints.keep_last == 2
    assert trainer.target_modules == ("q_proj", "v_proj", "lm_head")
    role = build_job_spec(config, "job.toml").roles["trainer"].config
    assert role["entrypoint"] == "rlplex.multirun.trainer:run_trainer"
    assert TrainerConfig.model_validate(role["config"]) == trainer  # rebuilt as the same model on the other side
    late = config.runs[0].model_copy(update={"config": {**config.runs[0].config, "max_async_level": 2}})
    problems = run_problems(late, config, "job.toml")
    assert any("max_async_level" in line and "trainer.max_off_policy_steps 1" in line for line in problems), problems


def test_an_orchestrator_that_generates_gets_the_cores_the_trainer_leaves() -> None:
    from rlplex.mainjob.orchestrator_node import generation_threads

    assert generation_threads({"trainer": 1, "orchestrator": 3}, cores=2) == 1  # never 0
    assert generation_threads({"trainer": 2, "orchestrator": 3}, cores=16) == 4
    assert generation_threads({"trainer": 1, "orchestrator": 1}, cores=8) == 7
    assert generation_threads({"trainer": 4, "orchestrator": 2}, cores=2) == 1  # more ranks than cores
