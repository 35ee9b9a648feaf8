"""What `rlplex runs add` reports of the trainer's decision, read from the files the trainer and
the orchestrator node write (the same run folders as a real job; the real job is exercised by
tests/test_readme_commands.py::test_main_job_commands)."""

from __future__ import annotations

import time
from pathlib import Path

from rlplex.mainjob.admission import trainer_decision, wait_for_trainer
from rlplex.mainjob.config import RunEntry
from rlplex.mainjob.registry import write_registry, write_rejection
from rlplex.multirun.rundir import STABLE_MARKER, RunDir, write_eviction

RUN = {"env": {"name": "reverse"}, "max_steps": 4, "batch_size": 8, "model": {"name": "m"}}


def new_run(out: Path, run_id: str) -> RunDir:
    out.mkdir(exist_ok=True)
    write_registry(out, [RunEntry(id=run_id, config=RUN)])
    (out / "runs" / run_id).mkdir(parents=True)
    run = RunDir(out / "runs", run_id)
    run.ensure_identity()
    return run


def test_pending_until_the_trainer_decides_then_admitted(tmp_path: Path) -> None:
    run = new_run(tmp_path, "run_a")
    waited: list[float] = []
    started = time.monotonic()
    decision = wait_for_trainer(tmp_path, "run_a", 0.5, waited.append)
    assert time.monotonic() - started >= 0.5 and waited
    assert decision.outcome == "pending"
    assert "validation pending" in decision.text and f"rlplex status {tmp_path}" in decision.text
    assert str(tmp_path / "rejected" / "run_a.txt") in decision.text and str(run.config_error) in decision.text
    (run.ensure_dir("broadcast", "step_0") / STABLE_MARKER).write_text("")  # the trainer's first adapter
    decision = wait_for_trainer(tmp_path, "run_a", 5.0)
    assert (decision.outcome, decision.text) == ("admitted", "run_a: admitted by the trainer")


def test_each_way_a_run_is_refused_is_rejected_with_its_reason(tmp_path: Path) -> None:
    run = new_run(tmp_path / "trainer", "run_a")
    run.write_text(run.config_error, "field 'model.lora.rank': 16 is more than 8\n")
    decision = trainer_decision(tmp_path / "trainer", "run_a")
    assert decision is not None and decision.outcome == "rejected" and "model.lora.rank" in decision.text

    new_run(tmp_path / "node", "run_a")
    write_rejection(tmp_path / "node", "run_a", "no-such.jsonl: data file not found")
    decision = trainer_decision(tmp_path / "node", "run_a")
    assert decision is not None and (decision.outcome, decision.text) == (
        "rejected",
        "no-such.jsonl: data file not found",
    )

    run = new_run(tmp_path / "evicted", "run_a")
    write_eviction(run, "cannot resume: no readable checkpoint")
    decision = trainer_decision(tmp_path / "evicted", "run_a")
    assert decision is not None and decision.outcome == "rejected" and "before the trainer admitted" in decision.text
    assert trainer_decision(tmp_path / "evicted", "run_other") is None  # not in the job
