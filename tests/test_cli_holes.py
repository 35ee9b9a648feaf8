"""Issue 18, the command line: bad input is one line (exit 2) found before anything starts, odd
files (FIFOs, corrupt databases) never freeze a command, and nothing is overwritten silently."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli_helpers import rlplex_in_process
from rlplex.control.job.store import SqliteStateStore
from rlplex.mainjob.config import RunEntry
from rlplex.mainjob.registry import write_registry
from rlplex.multirun.rundir import RunDir, write_eviction, write_finished
from timing import scaled

TRAIN = """
[env]
id = "CartPole-v1"
[sampler]
batch_T = 16
batch_B = 2
[agent]
hidden = {hidden}
[algo]
name = "ppo"
learning_rate = {lr}
n_epochs = 1
[runner]
kind = "minibatch"
n_steps = 64
log_interval_steps = 32
"""
ORCH = 'env = { name = "reverse" }\nmax_steps = 2\nbatch_size = 8\ngroup_size = 4\n'


def rlplex(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The command in this process, 200 columns wide; `timeout` is for `rlplex_process`'s cases."""
    return rlplex_in_process(*args, width=200)


def rlplex_process(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The real command in a child process: a regression that blocks (a FIFO read) fails on the
    timeout instead of freezing the test worker."""
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "rlplex.cli", *args], capture_output=True, text=True, timeout=scaled(timeout), env=env
    )


def assert_one_line_error(done: subprocess.CompletedProcess[str], *words: str) -> None:
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), output
    for word in words:
        assert word in lines[0], (word, output)


def test_help_keeps_bracketed_words() -> None:
    def help_text(*command: str) -> str:
        return " ".join(rlplex(*command, "--help").stdout.split())  # the lines as one, however wrapped

    assert "[env], [sampler], [agent], [algo], [runner]" in help_text("train")
    assert "[trainer], [[runs]], [[events]]" in help_text("run")
    assert "[roles.<name>]" in help_text("job", "run")


def test_h_is_help_everywhere_and_version_prints_the_package_version() -> None:
    """Issue 32, hole 8: `-h` beside `--help` (at every level: subcommands inherit it), every
    command's one line whole in the listings, and `--version`."""
    from rlplex import __version__

    groups = ((), ("job",), ("runs",), ("model",))
    for command in (*groups, ("train",), ("runs", "add"), ("job", "run"), ("model", "tiny")):
        short, long = rlplex_in_process(*command, "-h"), rlplex_in_process(*command, "--help")
        assert short.returncode == 0 and short.stdout == long.stdout and "Usage: " in short.stdout, (command, short)
        if command in groups:  # no command's line cut with "..." at 80 columns
            listing = rlplex_in_process(*command, "-h", width=80).stdout.split("Commands:")[-1]
            assert "..." not in listing and "…" not in listing, listing
    version = rlplex_in_process("--version")
    assert (version.returncode, version.stdout.strip()) == (0, f"rlplex {__version__}")


def test_no_help_shows_a_type_for_a_placeholder() -> None:
    """Issue 32, hole 8: an option's placeholder is its choices or a name (`local|ray`, `TASK`,
    `N`), never `<str>`, `<list[str]>` or `<int range>`; every command's help, walked from the root."""
    import typer

    from rlplex.cli import app

    def commands(command: Any, path: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
        if hasattr(command, "list_commands"):
            for name in command.list_commands(None):
                yield from commands(command.commands[name], (*path, name))
        else:
            yield path

    found = list(commands(typer.main.get_command(app), ()))
    assert len(found) >= 13 and ("model", "tiny") in found, found
    for path in found:
        text = rlplex(*path, "-h").stdout.split("Options:")[-1]
        for typed in ("<str>", "<list", "range>", "<text>"):
            assert typed not in text, (path, text)


@pytest.mark.parametrize(
    ("hidden", "lr", "field"),
    [("[64]", "inf", "algo.ppo.learning_rate"), ("[0]", "1e-3", "agent.hidden.0"), ("[1e9]", "1e-3", "agent.hidden")],
)
def test_train_refuses_values_that_cannot_work_before_it_starts(
    tmp_path: Path, hidden: str, lr: str, field: str
) -> None:
    config = tmp_path / "c.toml"
    config.write_text(TRAIN.format(hidden=hidden, lr=lr))
    done = rlplex("train", str(config), "--output", str(tmp_path / "out"), "--no-progress")
    assert_one_line_error(done, field)
    assert not (tmp_path / "out" / "progress.csv").exists()


@pytest.mark.slow
def test_train_keeps_an_earlier_run_unless_told_to_resume_or_overwrite(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(TRAIN.format(hidden="[8]", lr="1e-3"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "progress.csv").write_text("step,charts/online_return_mean\n64,12.5\n")
    done = rlplex("train", str(config), "--output", str(out), "--no-progress")
    assert_one_line_error(done, str(out), "--resume", "--overwrite")
    assert (out / "progress.csv").read_text() == "step,charts/online_return_mean\n64,12.5\n"
    done = rlplex("train", str(config), "--output", str(out), "--no-progress", "--overwrite", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "12.5" not in (out / "progress.csv").read_text()
    assert list((out / "snapshots").glob("itr_*"))


def test_train_into_a_file_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(TRAIN.format(hidden="[8]", lr="1e-3"))
    (tmp_path / "taken").write_text("keep me")
    done = rlplex("train", str(config), "--output", str(tmp_path / "taken"), "--no-progress")
    assert_one_line_error(done, str(tmp_path / "taken"), "--output")
    assert (tmp_path / "taken").read_text() == "keep me"
    done = rlplex("train", str(config), "--output", str(tmp_path / "taken" / "below"), "--no-progress")
    assert_one_line_error(done, "--output")


@pytest.mark.slow
def test_config_files_that_are_fifos_fail_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    job = make_job_folder(tmp_path / "job")
    for args in (("train", str(fifo)), ("run", str(fifo)), ("runs", "add", str(job), "--config", str(fifo))):
        assert_one_line_error(rlplex_process(*args), str(fifo), "not a regular file")


def make_job_folder(out: Path, run_ids: tuple[str, ...] = ("run_a",)) -> Path:
    """A main job's folder as `rlplex run` leaves it, without its processes: the run registry,
    the run folders and a state store."""
    out.mkdir(parents=True)
    write_registry(out, [RunEntry(id=run_id, config={"max_steps": 2}) for run_id in run_ids])
    for run_id in run_ids:
        RunDir(out / "runs", run_id).control.mkdir(parents=True)
    store = SqliteStateStore.in_dir(out)
    store.create_job("mj-1", "mj", "{}")
    store.close()
    return out


@pytest.mark.parametrize("odd", ["fifo_registry", "bad_registry", "fifo_store", "corrupt_store", "fifo_reason"])
def test_status_of_a_folder_with_odd_files_is_one_line_or_a_view(tmp_path: Path, odd: str) -> None:
    out = make_job_folder(tmp_path / "job")
    if odd == "fifo_registry":
        (out / "runs.json").unlink()
        os.mkfifo(out / "runs.json")
    elif odd == "bad_registry":
        (out / "runs.json").write_text(json.dumps([{"id": "run_a", "config": {}}, {"id": "../../x", "config": {}}]))
    elif odd == "fifo_store":
        (out / "job.sqlite").unlink()
        os.mkfifo(out / "job.sqlite")
    elif odd == "corrupt_store":
        for extra in ("job.sqlite-wal", "job.sqlite-shm"):
            if (out / extra).exists():
                (out / extra).unlink()
        (out / "job.sqlite").write_bytes(b"not a database at all" * 100)
    else:
        os.mkfifo(RunDir(out / "runs", "run_a").config_error)
    # A FIFO read that blocked would freeze this process: those cases run the real command.
    done = (rlplex_process if "fifo" in odd else rlplex)("status", str(out), timeout=30)
    if odd == "fifo_reason":  # the view comes up (the reason, not read, is a note)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "rejected" in done.stdout
        return
    file = "job.sqlite" if "store" in odd else "runs.json"
    assert_one_line_error(done, str(out / file))
    if odd == "bad_registry":
        assert "entry 1" in done.stdout and "'id'" in done.stdout


def test_runs_add_with_an_escaping_id_is_one_line(tmp_path: Path) -> None:
    out = make_job_folder(tmp_path / "job")
    config = tmp_path / "orch.toml"
    config.write_text(ORCH)
    done = rlplex("runs", "add", str(out), "--config", str(config), "--id", "../../escape", "--timeout-s", "1")
    assert_one_line_error(done, "--id", "../../escape")
    assert not (tmp_path / "escape").exists() and not list((out / "requests").glob("*"))


def test_adding_a_run_id_the_job_has_is_one_line_naming_the_job_and_no_request(tmp_path: Path) -> None:
    """Issue 32, hole 8: said at once, without the master's internal request file."""
    out = make_job_folder(tmp_path / "job")
    config = tmp_path / "orch.toml"
    config.write_text(ORCH + '[model]\nname = "some/model"\n')
    done = rlplex("runs", "add", str(out), "--config", str(config), "--id", "run_a", "--timeout-s", "1")
    assert_one_line_error(done, str(out), "'run_a' is already in the job", "another --id")
    assert "requests" not in done.stdout and not list((out / "requests").glob("*"))


def test_an_ended_run_cannot_be_evicted(tmp_path: Path) -> None:
    out = make_job_folder(tmp_path / "job", ("run_done", "run_gone", "run_live"))
    (RunDir(out / "runs", "run_done").finished).write_text(json.dumps({"step": 2, "time": time.time()}))
    write_eviction(RunDir(out / "runs", "run_gone"), "the first reason")
    done = rlplex("runs", "evict", str(out), "run_done", "--reason", "late")
    assert_one_line_error(done, "run_done", "already finished")
    assert not RunDir(out / "runs", "run_done").is_evicted()
    done = rlplex("runs", "evict", str(out), "run_gone", "--reason", "a second reason")
    assert_one_line_error(done, "already evicted", "the first reason")
    assert RunDir(out / "runs", "run_gone").eviction_reason() == "the first reason"
    done = rlplex("runs", "evict", str(out), "run_live", "--reason", "bad rollouts")
    assert done.returncode == 0, done.stdout
    assert RunDir(out / "runs", "run_live").eviction_reason() == "bad rollouts"


def test_status_tells_a_dead_master_from_a_live_one(tmp_path: Path) -> None:
    out = make_job_folder(tmp_path / "job")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    store = SqliteStateStore.in_dir(out)
    store.set_master("mj-1", "", int(dead.stdout))
    store.close()
    done = rlplex("status", str(out))
    assert done.returncode == 0, done.stdout
    assert f"master (pid {int(dead.stdout)}) is gone" in done.stdout and "rlplex resume" in done.stdout
    store = SqliteStateStore.in_dir(out)
    store.set_master("mj-1", "", os.getpid())  # this process: alive
    store.close()
    assert "is gone" not in rlplex("status", str(out)).stdout


def test_make_keeps_earlier_demo_results_in_a_dated_folder(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    earlier = tmp_path / "multirun-demo"
    earlier.mkdir()
    (earlier / "report.md").write_text("the first demo")
    for _ in range(2):
        done = subprocess.run(
            ["make", "-s", "-C", str(root), "keep-earlier", f"KEEP={earlier}"], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        earlier.mkdir()
        (earlier / "report.md").write_text("the second demo")
    kept = sorted(p for p in tmp_path.iterdir() if p.name.startswith("multirun-demo-"))
    assert [p.joinpath("report.md").read_text() for p in kept] == ["the first demo", "the second demo"]


def test_job_run_refuses_a_wrong_field_of_a_role_config_before_any_process_starts(tmp_path: Path) -> None:
    """Each Worker class declares its config model; the job file's roles are checked against it at load."""
    out = tmp_path / "job"
    job = tmp_path / "job.toml"
    job.write_text(
        f'name = "bad"\noutput_dir = "{out}"\n'
        '[roles.trainer]\nentrypoint = "rlplex.control.elastic:ElasticWorker"\n'
        'config = { module = "json.tool" }\n'
        '[roles.elastic]\nkind = "submaster"\nentrypoint = "rlplex.control.elastic:ElasticMaster"\n'
        'config = { workers = "trainer", min_nodez = 1 }\n'
    )
    assert_one_line_error(rlplex("job", "run", str(job)), "role 'elastic'", "field 'config.min_nodez'")
    assert not out.exists()  # nothing was created: no store, no node


def test_a_job_whose_every_run_was_rejected_fails_naming_each_run_and_why(tmp_path: Path) -> None:
    """Issue 32, hole 2: nothing trained is a failure (exit 1 through `guard`), not a quiet STOPPED."""
    from rlplex.errors import JobFailedError
    from rlplex.mainjob.driver import _fail_unless_a_run_finished

    out = make_job_folder(tmp_path / "job", ("run_a", "run_b"))
    RunDir(out / "runs", "run_a").config_error.write_text("lora rank 64 is more than max_lora_rank 8")
    RunDir(out / "runs", "run_b").config_error.write_text("model other/model is not the trainer's")
    with pytest.raises(JobFailedError) as info:
        _fail_unless_a_run_finished(out, out / "report.md")
    message = str(info.value)
    assert message.startswith("no run finished: run_a was rejected: lora rank 64") and "\n" not in message
    assert "run_b was rejected: model other/model" in message and message.endswith(f"report: {out / 'report.md'}")
    # One run that finished: the job did its work, whatever else was rejected.
    (RunDir(out / "runs", "run_b").config_error).unlink()
    RunDir(out / "runs", "run_b").finished.write_text(json.dumps({"step": 2, "time": time.time()}))
    _fail_unless_a_run_finished(out, out / "report.md")


MAIN_JOB = """
name = "advice"
output_dir = "{out}"
[model]
name = "{model}"
[trainer]
max_runs = 1
[[runs]]
id = "run_a"
config = {{ env = {{ name = "reverse" }}, max_steps = 2, batch_size = 8, group_size = 4 }}
"""


@pytest.mark.parametrize("state", ["running", "master_gone", "ended"])
def test_run_into_a_folder_with_a_job_suggests_what_works_in_its_state(tmp_path: Path, state: str) -> None:
    """Issue 32, hole 5: a live job is watched or stopped (not resumed), an unfinished one resumed,
    an ended one left alone; each time `--output` starts a new job elsewhere (it routes the job
    to that folder: here one that holds a job too, so the command stops at the same check)."""
    out = make_job_folder(tmp_path / "job")
    store = SqliteStateStore.in_dir(out)
    store.set_master("mj-1", "", os.getpid() if state == "running" else dead_pid())
    store.close()
    if state == "ended":
        write_finished(RunDir(out / "runs", "run_a"), 2)
    job_file = tmp_path / "job.toml"
    job_file.write_text(MAIN_JOB.format(out=out, model=tmp_path / "no-model-needed-yet"))
    done = rlplex("run", str(job_file), "--no-live")
    assert_one_line_error(done, str(out), "--output")
    line = done.stdout + done.stderr
    if state == "running":
        assert f"rlplex stop {out}" in line and f"rlplex status {out}" in line and "resume" not in line
    elif state == "master_gone":
        assert f"rlplex resume {out}" in line and "run_a" in line
    else:
        assert "resume" not in line and str(out / "report.md") in line
    other = make_job_folder(tmp_path / "other")
    assert_one_line_error(rlplex("run", str(job_file), "--no-live", "--output", str(other)), str(other))


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_train_refused_on_its_device_leaves_nothing_that_blocks_the_corrected_command(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: --device cuda is not refused")
    config = tmp_path / "c.toml"
    config.write_text(TRAIN.format(hidden="[8]", lr="1e-3"))
    out = tmp_path / "out"
    assert_one_line_error(rlplex("train", str(config), "--output", str(out), "--device", "cuda"), "cuda")
    assert not out.exists() or not any(out.iterdir())
    assert_one_line_error(rlplex("train", str(config), "--output", str(out), "--resume"), "--overwrite")
    done = rlplex("train", str(config), "--output", str(out), "--no-progress")
    assert done.returncode == 0, done.stdout


@pytest.mark.slow
def test_train_stopped_before_its_first_snapshot_suggests_overwrite_which_works(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    slow = TRAIN.format(hidden="[8]", lr="1e-3").replace("n_steps = 64", "n_steps = 10000000")
    config.write_text(slow.replace("log_interval_steps = 32", "log_interval_steps = 10000000"))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "rlplex.cli", "train", str(config), "--output", str(out), "--no-progress"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert process.stdout is not None
        first = process.stdout.readline()  # "training CartPole-v1 ...": the run has started
        assert first.startswith("training"), first
        process.send_signal(signal.SIGINT)
        rest = process.communicate(timeout=scaled(30))[0]
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGINT
    assert "before its first snapshot; start again with --overwrite" in rest and "--resume" not in rest, rest
    assert not list((out / "snapshots").glob("itr_*"))
    done = rlplex("train", str(config), "--output", str(out), "--no-progress", "--overwrite", "--n-steps", "64")
    assert done.returncode == 0, done.stdout


def test_a_reward_module_in_the_directory_rlplex_runs_in_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32, item 9: `reward = "my_reward:score"` beside the user's data, `rlplex check` run
    from that folder imports it and scores a row. The console script's path lacks the working
    directory (a `python -m` path has it), so this runs the command in process on a path without it;
    the job's nodes and reward children inherit the path the command extends."""
    from lm_models import small_tiny_model

    (tmp_path / "my_reward.py").write_text("def score(prompt, completion, answer):\n    return 1.0\n")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "r:abc>", "answer": "cba"}) + "\n")
    env = '{ name = "jsonl", path = "rows.jsonl", reward = "my_reward:score" }'
    job = MAIN_JOB.format(out="out", model=small_tiny_model()).replace('{ name = "reverse" }', env)
    (tmp_path / "job.toml").write_text(job)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    done = rlplex("check", "job.toml")
    assert done.returncode == 0 and "job.toml: ok" in done.stdout, done.stdout + done.stderr
