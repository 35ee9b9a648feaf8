"""Trackers (issue 34, item 3): what a run's MetricsLogger sends to TensorBoard and W&B, read
back from their own files; the trainer's rows forwarded by a run's orchestrator; `[logging]`
in a main job and in a `rlplex train` file."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlplex.config import validate_config
from rlplex.diagnostics.metrics import MetricsLogger
from rlplex.diagnostics.trackers import LoggingConfig, Tracking
from rlplex.errors import ConfigError
from rlplex.mainjob.config import MainJobConfig
from rlplex.multirun.orchestrator.trainer_rows import TrainerRows
from rlplex.multirun.rundir import RunDir
from rlplex.runners.config import TrainConfig
from timing import scaled, wait_for
from tracker_files import tensorboard_scalars


def log_a_run(log_dir: Path, tracking: Tracking) -> None:
    """What a run's orchestrator sends: its rollout rows, then the trainer's rows of the steps
    it already logged (lower steps, another namespace) and an evaluation."""
    with MetricsLogger(log_dir, tracking=tracking) as metrics:
        for step in range(3):
            metrics.log(step, {"charts/reward_mean": 0.5 + 0.1 * step, "charts/tokens_per_s": 100.0 + step})
        metrics.track(1, {"trainer/loss": 0.25, "trainer/grad_norm": 1.5})
        metrics.track(2, {"trainer/loss": 0.125, "trainer/grad_norm": float("nan")})  # NaN: drawn as nothing
        metrics.track(2, {"eval/accuracy_t0": 0.75})


def test_tensorboard_gets_every_metric_of_the_csv_and_the_tracked_rows(tmp_path: Path) -> None:
    log_a_run(tmp_path / "run_a", Tracking(LoggingConfig(), "run_a"))
    scalars = tensorboard_scalars(tmp_path / "run_a" / "tb")
    assert scalars["charts/reward_mean"] == [(0, 0.5), (1, pytest.approx(0.6)), (2, pytest.approx(0.7))]
    assert [step for step, _ in scalars["charts/tokens_per_s"]] == [0, 1, 2]
    assert scalars["trainer/loss"] == [(1, 0.25), (2, 0.125)] and scalars["trainer/grad_norm"] == [(1, 1.5)]
    assert scalars["eval/accuracy_t0"] == [(2, 0.75)]
    # The CSV holds the logged rows only: the tracked ones are another file's (the trainer's, the evaluator's).
    header = (tmp_path / "run_a" / "progress.csv").read_text().splitlines()[0]
    assert header == "step,charts/reward_mean,charts/tokens_per_s"


def test_a_job_folder_gathers_each_runs_tensorboard_under_its_name(tmp_path: Path) -> None:
    log_a_run(tmp_path / "runs" / "run_a", Tracking(LoggingConfig(), "run_a", directory=tmp_path))
    assert "trainer/loss" in tensorboard_scalars(tmp_path / "tb" / "run_a")
    assert not (tmp_path / "runs" / "run_a" / "tb").exists()
    log_a_run(tmp_path / "quiet", Tracking(LoggingConfig(tensorboard=False), "quiet"))
    assert not (tmp_path / "quiet" / "tb").exists()


def test_wandb_offline_run_holds_the_rows_with_their_steps_its_group_and_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    from tracker_files import history, records, run_record

    monkeypatch.delenv("WANDB_MODE", raising=False)
    settings = LoggingConfig(wandb=True, wandb_group="mj-demo", tensorboard=False)
    log_a_run(tmp_path / "run_a", Tracking(settings, "run_a", {"optim": {"lr": 0.005}}))
    (path,) = (tmp_path / "run_a" / "wandb").glob("offline-run-*/run-*.wandb")

    def finished() -> bool:  # the exit record is W&B's last word on a run
        return any(r.WhichOneof("record_type") == "exit" for r in records(path))

    wait_for(finished, scaled(20), "the W&B run's exit record")
    rows = [{k: v for k, v in row.items() if not k.startswith("_")} for row in history(path)]
    assert rows == [
        {"step": 0, "charts/reward_mean": 0.5, "charts/tokens_per_s": 100},
        {"step": 1, "charts/reward_mean": pytest.approx(0.6), "charts/tokens_per_s": 101},
        {"step": 2, "charts/reward_mean": pytest.approx(0.7), "charts/tokens_per_s": 102},
        {"step": 1, "trainer/loss": 0.25, "trainer/grad_norm": 1.5},
        {"step": 2, "trainer/loss": 0.125},
        {"step": 2, "eval/accuracy_t0": 0.75},
    ]
    run = run_record(path)
    assert (run.run_id, run.run_group, run.display_name, run.project) == ("mj-demo-run_a", "mj-demo", "run_a", "rlplex")
    assert {item.key: item.value_json for item in run.config.update}["optim"] == '{"lr":0.005}'
    # Every metric is drawn against `step`: W&B's own step must only rise, ours need not.
    metrics = [r.metric for r in records(path) if r.WhichOneof("record_type") == "metric"]
    assert any(m.glob_name == "*" and m.step_metric == "step" for m in metrics), metrics


def test_wandb_mode_from_the_environment_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    log_a_run(tmp_path, Tracking(LoggingConfig(wandb=True, tensorboard=False), "run_a"))
    assert not list(tmp_path.glob("wandb/offline-run-*")), list(tmp_path.rglob("*"))


def test_wandb_missing_is_one_config_error_naming_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"logging.wandb = true needs the wandb package: pip install wandb=="):
        MetricsLogger(tmp_path, tracking=Tracking(LoggingConfig(wandb=True)))
    assert not (tmp_path / "tb").exists()  # refused before any tracker made a file


def test_trainer_rows_are_forwarded_once_each_with_the_trainers_tokens_per_s(tmp_path: Path) -> None:
    (tmp_path / "run_a").mkdir()
    run = RunDir(tmp_path, "run_a")
    log = run.ensure_dir("logs") / "trainer_progress.csv"
    header = "step,total_tokens,total_samples,loss,reward_mean,policy_step,stale_dropped,grad_norm,lr,slot,time\n"
    log.write_text(header + "1,100,8,0.5,0.6,0,0,1.2,0.005,0,1000.0\n2,300,16,0.4,0.7,1,0,1.1,0.005,0,1002.0\n3,4")
    sent: list[tuple[int, dict[str, float]]] = []
    rows = TrainerRows(run)
    assert rows.forward(lambda step, metrics: sent.append((step, dict(metrics)))) == 2
    assert [step for step, _ in sent] == [1, 2]  # the torn last line waits for its end
    assert set(sent[0][1]) == {"trainer/" + k for k in header.strip().split(",") if k not in ("step", "slot", "time")}
    assert sent[1][1]["trainer/tokens_per_s"] == 100.0 and "trainer/tokens_per_s" not in sent[0][1]
    log.write_text(header + "1,100,8,0.5,0.6,0,0,1.2,0.005,0,1000.0\n2,300,16,0.4,0.7,1,0,1.1,0.005,0,1002.0\n"
                   "3,700,24,0.3,0.8,2,1,1.0,0.005,0,1006.0\n")  # fmt: skip
    assert rows.forward_until(lambda step, metrics: sent.append((step, dict(metrics))), 3, timeout_s=scaled(5))
    assert [step for step, _ in sent] == [1, 2, 3] and sent[2][1]["trainer/stale_dropped"] == 1.0
    # A restarted orchestrator does not send again what its first life sent.
    again: list[int] = []
    TrainerRows(run, after_step=2).forward(lambda step, _metrics: again.append(step))
    assert again == [3]


JOB = {"name": "mj demo", "output_dir": "out", "model": {"name": "m"}}
RUN = {"env": {"name": "reverse"}, "max_steps": 2, "batch_size": 4}


def test_a_jobs_logging_reaches_every_run_grouped_by_the_jobs_name() -> None:
    runs = [{"id": "run_a", "config": RUN}, {"id": "run_b", "config": RUN | {"logging": {"wandb_project": "b"}}}]
    job = MainJobConfig.model_validate(JOB | {"runs": runs, "logging": {"wandb": True, "print_every_s": 5}})
    first, second = (entry.orch_config("test").logging for entry in job.runs)
    assert (first.wandb, first.wandb_group, first.wandb_project, first.print_every_s) == (True, "mj demo", "rlplex", 5)
    assert (second.wandb, second.wandb_project) == (True, "b")  # the run's own key wins
    assert job.run_logging() == first  # a run added while the job runs gets the same
    with pytest.raises(ConfigError, match=r"job.toml: field 'logging.wandb_mode'.*'offline'.*\(got 'cloud'\)"):
        validate_config(MainJobConfig, JOB | {"runs": runs, "logging": {"wandb_mode": "cloud"}}, "job.toml")


def test_a_train_file_takes_logging() -> None:
    config = validate_config(TrainConfig, {"env": {"id": "CartPole-v1"}, "logging": {"tensorboard": False}})
    assert config.logging.tensorboard is False
    with pytest.raises(ConfigError, match=r"field 'logging.print_every_s'"):
        validate_config(TrainConfig, {"env": {"id": "CartPole-v1"}, "logging": {"print_every_s": 0}})
