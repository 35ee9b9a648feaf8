"""The main job's live view in a terminal of a given size, and its elapsed times and ETAs."""

from __future__ import annotations

import dataclasses
import io
import json
import os
from pathlib import Path

import pytest
from rich.cells import cell_len
from rich.console import Console
from rich.live import Live

from rlplex.control.job.store import NodeRecord
from rlplex.mainjob.config import RunEntry
from rlplex.mainjob.frame import node_rows, render
from rlplex.mainjob.registry import write_registry
from rlplex.mainjob.report import write_report
from rlplex.mainjob.timing import ETA_WINDOW_STEPS, eta_s, format_duration, seconds_per_step, step_history
from rlplex.mainjob.view import InferenceView, JobView, RunView, collect
from rlplex.multirun.rundir import STABLE_MARKER, RunDir, write_eviction, write_finished

NOW = 1_700_000_000.0
REASON = "bad rollouts: " + " ".join(f"reward{i}=nan" for i in range(30))  # 300 characters of words


def rows(steps: int, every_s: float = 20.0, first: float = NOW - 600) -> list[dict[str, float]]:
    return [{"step": s, "time": first + every_s * s, "total_tokens": 100.0 * s} for s in range(1, steps + 1)]


def run(run_id: str, state: str, steps: int, reason: str = "") -> RunView:
    return RunView(run_id, state, steps, 40, reward=0.5, tokens_per_s=1234.0, reason=reason,
                   trainer_rows=rows(steps, first=NOW - 5.0 - 20.0 * steps), started_at=NOW - 620)  # fmt: skip


def node(role: str, rank: int, state: str = "RUNNING") -> NodeRecord:
    progress = json.dumps({"step": 3, "tokens": 12345, "loss": 0.25, "policy_step": 2})
    return NodeRecord("mj-1", f"{role}-{rank}", role, rank, state, 100 + rank, NOW, "", 0, 1, NOW - 0.4, progress, "")


def job(runs: list[RunView], state: str = "RUNNING", updated_at: float | None = None) -> JobView:
    nodes = [node("trainer", 0), node("trainer", 1), *(node("orchestrator", rank) for rank in range(4))]
    rendezvous = ["trainer-0 (role 'trainer'): rendezvous RUNNING, world 2, restarts 0, epoch 1"]
    inference = InferenceView("hf", 1, [], None)
    return JobView(Path("/jobs/out"), state, "", nodes, runs, NOW, rendezvous, NOW - 700, inference, 0, updated_at)


def four_runs() -> list[RunView]:
    return [run("run_alpha", "running", 10), run("run_beta", "evicted", 3, REASON),
            run("run_gamma", "waiting", 0), run("run_delta", "finished", 40)]  # fmt: skip


def draw(view: JobView, width: int, height: int, live: bool = True) -> list[str]:
    console = Console(width=width, height=height, file=io.StringIO(), record=True, color_system=None)
    console.print(render(view, live=live))
    return console.export_text().splitlines()


def fits(lines: list[str], width: int, height: int) -> None:
    assert len(lines) <= height, "\n".join(lines)
    assert all(cell_len(line) <= width for line in lines), "\n".join(lines)


@pytest.mark.parametrize(("width", "height"), [(80, 24), (200, 50)])
def test_the_live_view_fits_the_terminal_and_shows_the_job_and_every_run(width: int, height: int) -> None:
    lines = draw(job(four_runs()), width, height)
    fits(lines, width, height)
    assert lines[0].startswith("job RUNNING · elapsed 11m40s · ETA —")  # run_gamma has no step yet
    rows_of = {line.split()[0]: line.split() for line in lines if line.startswith("run_")}
    assert rows_of["run_alpha"][1:3] == ["running", "10/40"] and rows_of["run_alpha"][-2:] == ["10m20s", "9m55s"]
    assert rows_of["run_beta"][1] == "evicted" and rows_of["run_beta"][-1] == "—"
    assert rows_of["run_gamma"][1:3] == ["waiting", "0/40"] and rows_of["run_gamma"][-1] == "—"
    assert rows_of["run_delta"][-1] == "done"
    note = next(line for line in lines if line.startswith("note: run_beta evicted: bad rollouts: reward0=nan"))
    assert note.endswith("…") and len(note) == width  # cut to the width: the full text is in status and the report
    orchestrators = [line.split() for line in lines if line.startswith("orchestrator")]
    assert [row[2] for row in orchestrators] == ["run_alpha", "run_beta", "run_gamma", "run_delta"]
    assert sum(line.startswith("trainer ") for line in lines) == 2  # every node fits at both sizes


def test_status_prints_every_note_in_full_in_the_width() -> None:
    lines = draw(job(four_runs()), 80, 24, live=False)
    fits(lines, 80, 100)
    text = "".join(lines).replace(" ", "")
    assert ("note:run_betaevicted:" + REASON).replace(" ", "") in text


def test_a_short_terminal_keeps_the_job_line_and_the_runs_and_counts_what_is_left_out() -> None:
    runs = [run(f"run_{i:02d}", "finished", 40) for i in range(25)] + four_runs()
    lines = draw(job(runs), 80, 24)
    fits(lines, 80, 24)
    assert lines[0].startswith("job RUNNING") and lines[1].startswith("trainer: ")
    shown = [line.split()[0] for line in lines if line.startswith("run_")]
    # Runs still going come first when not all fit; the rest are counted, as are the nodes.
    assert shown[:3] == ["run_alpha", "run_gamma", "run_beta"]
    more = next(line for line in lines if line.startswith("+"))
    assert more == f"+{len(runs) - len(shown)} more runs ({len(runs) - len(shown)} finished)"
    assert lines[-1] == "6 nodes (6 RUNNING)"
    for width, height in ((80, 10), (40, 12), (30, 5), (120, 3)):
        fits(draw(job(runs), width, height), width, height)
    narrow = draw(job(four_runs()), 40, 12)
    assert [line.split()[0] for line in narrow if line.startswith("run_")] == [r.run_id for r in four_runs()]
    # As `rlplex run` draws it: rich's Live never has to cut the frame (it would end it with "...").
    terminal = io.StringIO()
    console = Console(file=terminal, force_terminal=True, width=80, height=24, color_system=None)
    with Live(render(job(runs), live=True), console=console, auto_refresh=False) as live:
        live.update(render(job(runs), live=True), refresh=True)
    assert "..." not in terminal.getvalue() and "+10 more runs (10 finished)" in terminal.getvalue()


def test_node_rows_name_the_run_each_orchestrator_and_rollout_node_serves() -> None:
    view = job(four_runs())
    view.nodes = [node("orchestrator", 1), node("rollout", 0), node("rollout", 1), node("trainer", 0)]
    view.rollout_runs = ["run_gamma", "run_gamma"]
    serves = {(r[0], r[1]): r[2] for r in node_rows(view, view.nodes)}
    assert serves == {("orchestrator", "1"): "run_beta", ("rollout", "0"): "run_gamma",
                      ("rollout", "1"): "run_gamma", ("trainer", "0"): ""}  # fmt: skip


def test_nodes_left_out_are_counted_and_failed_ones_shown_first() -> None:
    view = job(four_runs()[:1])
    view.nodes = [node("orchestrator", rank) for rank in range(30)] + [node("trainer", 0, "FAILED")]
    lines = draw(view, 80, 24)
    fits(lines, 80, 24)
    nodes = [line.split() for line in lines if line.startswith(("orchestrator", "trainer "))]
    assert nodes[0][0] == "trainer" and nodes[0][2] == "FAILED"
    assert lines[-1] == f"+{31 - len(nodes)} more nodes ({31 - len(nodes)} RUNNING)"


def test_eta_is_the_remaining_steps_at_the_median_pace_of_the_newest_steps() -> None:
    history = step_history(rows(6, every_s=10.0, first=0.0))
    history[3:] = [(step, at + 100.0) for step, at in history[3:]]  # a restart between steps 3 and 4
    assert seconds_per_step(history) == 10.0  # the 100 s gap does not set the pace
    last = history[-1][1]
    assert eta_s(history, 40, clock=last) == pytest.approx(34 * 10.0)
    assert eta_s(history, 40, clock=last + 4.0) == pytest.approx(34 * 10.0 - 4.0)  # counts down between steps
    assert eta_s(history, 40, clock=last + 60.0) == pytest.approx(33 * 10.0)  # an overdue step is under way
    assert eta_s(history, 6, clock=last) == 0.0
    # Only the newest ETA_WINDOW_STEPS steps count: a run that got faster is judged by its new pace.
    slow = [(step, 50.0 * step) for step in range(1, 31)]
    faster = slow + [(30 + k, 1500.0 + 5.0 * k) for k in range(1, ETA_WINDOW_STEPS + 1)]
    assert seconds_per_step(slow) == 50.0 and seconds_per_step(faster) == pytest.approx(5.0)
    # A trainer resumed from an older checkpoint trains steps 4 and 5 again: the newer rows count.
    resumed = step_history([*rows(5, first=0.0), *rows(7, every_s=30.0, first=0.0)[3:]])
    assert resumed == [(1, 20.0), (2, 40.0), (3, 60.0), (4, 120.0), (5, 150.0), (6, 180.0), (7, 210.0)]
    assert seconds_per_step(resumed) == pytest.approx(30.0)  # median of 20, 20, 60, 30, 30, 30


def test_eta_is_unknown_before_the_first_step_then_paced_by_the_run_start() -> None:
    assert eta_s([], 40, clock=NOW) is None and format_duration(None) == "—"
    view = job([run("run_new", "waiting", 0)])
    assert view.run_eta_s(view.runs[0]) is None and view.eta_s is None
    assert "—" in next(line for line in draw(view, 80, 24) if line.startswith("run_new"))
    one = [(1, NOW - 580.0)]
    assert seconds_per_step(one, started_at=NOW - 620.0) == pytest.approx(40.0)
    assert eta_s(one, 40, clock=NOW - 580.0, started_at=NOW - 620.0) == pytest.approx(39 * 40.0)
    assert [format_duration(s) for s in (0.4, 59.6, 185, 3725, 2 * 86400 + 3 * 3600)] == [
        "0s", "1m00s", "3m05s", "1h02m", "2d03h"]  # fmt: skip


def test_job_eta_is_its_slowest_runs_and_times_stop_with_the_job() -> None:
    runs = [run("run_a", "running", 10), run("run_b", "running", 30), run("run_c", "finished", 40)]
    view = job(runs)
    etas = [view.run_eta_s(r) for r in runs]
    assert etas == [pytest.approx(30 * 20.0 - 5.0), pytest.approx(10 * 20.0 - 5.0), 0.0]
    assert view.eta_s == pytest.approx(max(e for e in etas if e is not None))
    assert view.elapsed_s == pytest.approx(700.0) and view.run_elapsed_s(runs[0]) == pytest.approx(620.0)
    stopped = job(runs, state="STOPPED", updated_at=NOW - 100.0)
    assert stopped.elapsed_s == pytest.approx(600.0) and stopped.run_elapsed_s(runs[0]) == pytest.approx(520.0)
    assert stopped.eta_s is None and stopped.run_eta_s(runs[0]) is None  # nothing trains until it resumes


def test_collect_times_runs_from_their_folders_and_the_report_shows_them(tmp_path: Path) -> None:
    runs_dir = tmp_path / "runs"
    config = {"env": {"name": "reverse"}, "max_steps": 4, "batch_size": 8, "model": {"name": "m"}}
    write_registry(tmp_path, [RunEntry(id=i, config=config) for i in ("run_done", "run_mid", "run_gone")])
    for run_id, steps in (("run_done", 4), ("run_mid", 2), ("run_gone", 1)):
        (runs_dir / run_id).mkdir(parents=True)
        folder = RunDir(runs_dir, run_id)
        folder.ensure_identity()
        os.utime(folder.identity_file, (NOW - 100.0, NOW - 100.0))
        for step in range(1, steps + 1):
            (folder.ensure_dir("broadcast", f"step_{step}") / STABLE_MARKER).write_text("")
        lines = ["step,total_tokens,time", *(f"{s},{10 * s},{NOW - 100.0 + 20.0 * s}" for s in range(1, steps + 1))]
        (folder.ensure_dir("logs") / "trainer_progress.csv").write_text("\n".join(lines) + "\n")
    write_finished(RunDir(runs_dir, "run_done"), 4)
    os.utime(RunDir(runs_dir, "run_done").finished, (NOW - 15.0, NOW - 15.0))
    write_eviction(RunDir(runs_dir, "run_gone"), REASON)
    os.utime(RunDir(runs_dir, "run_gone").evicted, (NOW - 70.0, NOW - 70.0))
    view = collect(tmp_path)
    by_id = {r.run_id: r for r in view.runs}
    assert [r.state for r in view.runs] == ["finished", "running", "evicted"]
    assert view.run_elapsed_s(by_id["run_done"]) == pytest.approx(85.0)
    assert view.run_elapsed_s(by_id["run_gone"]) == pytest.approx(30.0)
    assert view.run_elapsed_s(by_id["run_mid"]) == pytest.approx(view.read_at - (NOW - 100.0))
    assert by_id["run_mid"].seconds_per_step == pytest.approx(20.0)
    # Its clock is now, long after its last step: that step is taken as under way, one is left after it.
    assert view.run_eta_s(by_id["run_mid"]) == pytest.approx(20.0)
    text = write_report(tmp_path, fallback_wall_time_s=1.0).read_text()
    assert "| run_done | finished | 4/4 |" in text and "| 1m25s | 20.00 |" in text
    assert f"| 30s | 20.00 | {REASON} |" in text  # a single step: paced from the run's start


def test_without_a_live_view_a_line_per_active_run_comes_every_period_and_at_each_change() -> None:
    from rlplex.mainjob.lines import ProgressLines

    lines = ProgressLines(every_s=30.0)
    first = lines.lines(job(four_runs()), now=100.0)
    # The first call: every run once (its state is new), each with what the table shows.
    assert [line.split()[2] for line in first] == ["run_alpha", "run_beta", "run_gamma", "run_delta"]
    alpha = first[0].split()
    assert alpha[:2] == ["[", "11m40s]"] and alpha[3:] == ["running", "step", "10/40", "reward", "0.500",
                                                          "tokens/s", "1234", "ETA", "9m55s"]  # fmt: skip
    assert first[1].endswith(REASON) and first[3].endswith("ETA done")
    assert lines.lines(job(four_runs()), now=110.0) == []  # nothing changed, the period has not come
    changed = four_runs()
    changed[0] = run("run_alpha", "finished", 40)
    assert [line.split()[2] for line in lines.lines(job(changed), now=120.0)] == ["run_alpha"]
    # The period: only the runs still under way (waiting, running, evaluating).
    assert [line.split()[2] for line in lines.lines(job(changed), now=130.0)] == ["run_gamma"]


def test_run_main_job_prints_lines_when_its_console_is_no_terminal() -> None:
    """The driver's choice, without a job: a console to a file gets lines, a terminal the live view."""
    from rlplex.mainjob.driver import _show
    from rlplex.mainjob.lines import ProgressLines

    console = Console(file=io.StringIO(), width=200)
    _show(job(four_runs()), None, ProgressLines(30.0), console, now=0.0)
    printed = console.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert len(printed) == 4 and "run_alpha    running    step 10/40" in printed[0]


def test_what_an_orchestrator_says_it_does_shows_until_its_runs_first_step() -> None:
    """Issue 32, hole 7: for the minute a model takes to load, a run said only "running, step 0,
    reward -". Its orchestrator node's heartbeat counters (`phase`, `phase_step`) now say what it
    does, in the lines, the live view's notes and the dashboard (the e2e test sees them there)."""
    from rlplex.mainjob.lines import run_line
    from rlplex.mainjob.view import _say_what_orchestrators_do
    from rlplex.multirun.orchestrator.phase import Phase

    fresh = RunView("run_new", "running", 0, 40, started_at=NOW - 30, settings={"inference": {"engine": "vllm"}})
    runs = [run("run_alpha", "running", 10), fresh, run("run_done", "finished", 40)]
    said = [(Phase.GENERATING, 11), (Phase.PREPARING, 0), (Phase.WAITING, 40)]
    nodes = [
        dataclasses.replace(node("orchestrator", rank), progress_json=json.dumps({"phase": float(p), "phase_step": s}))
        for rank, (p, s) in enumerate(said)
    ]
    _say_what_orchestrators_do(runs, nodes)
    assert [r.doing for r in runs] == ["generating step 11", "reaching the inference servers", ""]
    view = job(runs)
    assert run_line(view, runs[1]).endswith("ETA —  reaching the inference servers")
    text = "\n".join(draw(view, 80, 24))
    assert "note: run_new: reaching the inference servers" in text  # no step yet: said under the table
    assert "run_alpha: generating" not in text  # a run with steps says it in its row already


def test_the_newest_held_out_score_shows_in_the_table_status_and_lines() -> None:
    """Issue 32, item 11: a run's evaluation reaches the live view and `rlplex status` (the same
    frame) and the plain lines, not the report and the dashboard alone."""
    from rlplex.mainjob.lines import run_line

    scored = run("run_eval", "running", 10)
    scored.evaluations = [{"step": 0.0, "eval/accuracy_t0": 0.25}, {"step": 10.0, "eval/accuracy_t0": 0.625}]
    view = job([scored, run("run_plain", "running", 10)])
    assert "held-out 0.625  tokens/s" in run_line(view, scored)
    assert "held-out" not in run_line(view, view.runs[1])
    table = draw(view, 200, 50)
    header = next(line for line in table if "held-out" in line)
    column = header.index("held-out")
    values = {line.split()[0]: line[column : column + 8].strip() for line in table if line.startswith("run_")}
    assert values == {"run_eval": "0.625", "run_plain": "-"}
