"""What the job looks like right now, read from files alone: the live view, `rlplex status`
and the report all use `collect()`, so a second shell sees what the master sees.

A run's trainer step is the newest stable `broadcast/step_N` (the trainer writes it after
stepping the run); its reward and rollout throughput come from the orchestrator's
`progress.csv`; evictions, rejected configs and finished runs from the run's `control/` files.
A run is `finished` only once the trainer has written `control/finished.txt` (its last step
checkpointed and broadcast, its slot freed), the same rule as `MultiRunManager.run_statuses()`;
before that a run whose last broadcast is out is still `running`. A run's elapsed time runs
from its folder being made to its end marker; its ETA comes from the trainer's progress rows
(`timing.py`). `frame.py` draws a `JobView`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from rlplex.control.elastic.master import rendezvous_summaries
from rlplex.control.job.master import MasterLock
from rlplex.control.job.states import TERMINAL_JOB_STATES, JobState, NodeState, job_outcome
from rlplex.control.job.store import STORE_FILE, JobRecord, JobStore, LogRecord, NodeRecord
from rlplex.errors import ConfigError
from rlplex.io.safe_files import check_regular_file, read_regular_text
from rlplex.mainjob.build import ORCHESTRATOR_ROLE
from rlplex.mainjob.config import INFERENCE_DIR, JOB_CONFIG_FILE, RunEntry
from rlplex.mainjob.progress_rows import read_progress_rows
from rlplex.mainjob.registry import REJECTIONS_DIR, read_registry, rejection_reason, rollout_slots
from rlplex.mainjob.timing import eta_s, job_eta_s, seconds_per_step, step_history
from rlplex.multirun.orchestrator.phase import describe
from rlplex.multirun.rundir import RunDir, stable_steps, unwritten_eviction_path

MAX_STORE_BYTES = 64 << 30

REWARD_COLUMNS = ("reward_mean", "charts/reward_mean", "reward")
# Start and end rewards are means over this many steps: one step's reward is a noisy sample.
REWARD_WINDOW = 10
# The trainer's throughput is measured over the newest stretch of its progress logs.
THROUGHPUT_WINDOW_S = 30.0
TOKENS_COLUMNS = ("tokens_per_s", "charts/tokens_per_s")
LAG_COLUMNS = ("policy_lag", "charts/policy_lag")
ADAPTER_LOAD_COLUMN = "charts/adapter_load_s"


@dataclass
class RunView:
    run_id: str
    state: str  # waiting, running, evaluating (trained, its last evaluation pending), finished, evicted, rejected
    trained_steps: int
    max_steps: int
    reward: float | None = None
    tokens_per_s: float | None = None
    reason: str = ""
    trained_tokens: int = 0
    curve: list[tuple[float, float]] = field(default_factory=list)
    trainer_rows: list[dict[str, float]] = field(default_factory=list)
    adapter_loads_s: list[float] = field(default_factory=list)  # each step's adapter load, when one was loaded
    rollout_tokens_per_s: list[float] = field(default_factory=list)  # each written step's generation rate
    evaluations: list[dict[str, float]] = field(default_factory=list)  # held-out evaluations, by policy step
    started_at: float | None = None  # wall clock: when its folder was made (its identity written)
    ended_at: float | None = None  # wall clock: when it finished, was evicted or was rejected
    policy_lag: float | None = None  # steps its newest rollouts' policy was behind the step they trained
    settings: dict[str, Any] = field(default_factory=dict)  # its orchestrator config, as it joined
    doing: str = ""  # what its orchestrator says it is doing now ("": not running, or not said yet)

    # `steps`, with the rows (the list itself, and how many) it was computed from: the ETAs ask
    # for it several times per view, and each time walks every row.
    _steps: tuple[list[dict[str, float]], int, list[tuple[int, float]]] | None = field(
        default=None, repr=False, compare=False
    )

    @property
    def steps(self) -> list[tuple[int, float]]:
        """(step, wall time) of each step the trainer trained, from its progress log."""
        rows = self.trainer_rows
        if self._steps is None or self._steps[0] is not rows or self._steps[1] != len(rows):
            self._steps = (rows, len(rows), step_history(rows))
        return self._steps[2]

    @property
    def seconds_per_step(self) -> float | None:
        return seconds_per_step(self.steps, self.started_at)

    def _window_mean(self, newest: bool) -> float | None:
        rewards = [reward for _, reward in self.curve]
        if not rewards:
            return None
        window = max(1, min(REWARD_WINDOW, len(rewards) // 2))
        chosen = rewards[-window:] if newest else rewards[:window]
        return sum(chosen) / len(chosen)

    def heldout_scores(self) -> tuple[str, list[float], list[float]] | None:
        """(column, policy steps, scores) of its held-out evaluations, by the first column it has:
        greedy accuracy, else greedy reward, else a classic run's evaluation return."""
        for column in HELDOUT_COLUMNS:
            rows = [row for row in self.evaluations if column in row and "step" in row]
            if rows:
                return column, [row["step"] for row in rows], [row[column] for row in rows]
        return None

    @property
    def heldout(self) -> float | None:
        """Its newest held-out score (None: not evaluated yet, or no evaluation asked)."""
        scores = self.heldout_scores()
        return None if scores is None else scores[2][-1]

    @property
    def reward_start(self) -> float | None:
        """Mean reward of the first steps."""
        return self._window_mean(newest=False)

    @property
    def reward_end(self) -> float | None:
        """Mean reward of the newest steps."""
        return self._window_mean(newest=True)

    @property
    def reward_rise(self) -> float | None:
        start, end = self.reward_start, self.reward_end
        return None if start is None or end is None or len(self.curve) < 2 else end - start


@dataclass
class InferenceView:
    """The job's rollout engine: which one, its servers, and what the runs measured of it."""

    engine: str  # "hf" or "vllm"
    replicas: int
    urls: list[str]
    incarnation: int | None  # of the servers now up (None: none up)

    def describe(self, runs: list[RunView]) -> str:
        active = [run.tokens_per_s for run in runs if run.state == "running" and run.tokens_per_s is not None]
        loads = sorted(s for run in runs for s in run.adapter_loads_s)
        text = f"inference: {self.engine}"
        if self.engine == "vllm":
            up = f"up at {', '.join(self.urls)} (incarnation {self.incarnation})" if self.urls else "not up"
            text += f", {self.replicas} replica(s) {up}"
        text += f"; rollout tokens/s of running runs: {sum(active):.0f}" if active else ""
        if loads:
            p50, p99 = loads[len(loads) // 2], loads[min(len(loads) - 1, int(0.99 * len(loads)))]
            text += f"; adapter loads: {len(loads)}, p50 {1000 * p50:.0f} ms, p99 {1000 * p99:.0f} ms"
        return text


def read_inference(output_dir: Path) -> InferenceView | None:
    """The engine of the job in `output_dir` (its main_job.json) and its endpoint, if any."""
    try:
        job = json.loads(read_regular_text(output_dir / JOB_CONFIG_FILE))
        settings = job.get("inference") or {}
        view = InferenceView(str(settings.get("engine", "hf")), int(settings.get("replicas", 1)), [], None)
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    try:
        endpoint = json.loads(read_regular_text(output_dir / INFERENCE_DIR / "endpoint.json"))
        view.urls, view.incarnation = [str(u) for u in endpoint["urls"]], int(endpoint["incarnation"])
    except (OSError, ValueError, TypeError, KeyError):
        pass
    return view


@dataclass
class JobView:
    output_dir: Path
    job_state: str
    job_cause: str
    nodes: list[NodeRecord]
    runs: list[RunView]
    read_at: float
    rendezvous: list[str] = field(default_factory=list)  # the trainer's elastic restarts
    created_at: float | None = None  # when the job was created (wall clock), across master restarts
    inference: InferenceView | None = None
    master_pid: int = 0
    updated_at: float | None = None  # the job's last state change (wall clock)
    rollout_runs: list[str] = field(default_factory=list)  # the run rollout node r generates for
    events: list[LogRecord] = field(default_factory=list)  # the newest transitions and decisions, when asked

    @property
    def outcome(self) -> str:
        """The job's state as every command and the report say it (`job_outcome`)."""
        return job_outcome(self.job_state, self.job_cause)

    @property
    def ended_at(self) -> float | None:
        """When the job stopped or failed (None: it has not)."""
        return self.updated_at if self.job_state in {s.value for s in TERMINAL_JOB_STATES} else None

    @property
    def clock(self) -> float:
        """The time elapsed and ETA are measured at: now, or when the job ended."""
        return self.ended_at or self.read_at

    @property
    def elapsed_s(self) -> float | None:
        return None if self.created_at is None else max(0.0, self.clock - self.created_at)

    def run_elapsed_s(self, run: RunView) -> float | None:
        """From the run's folder being made to its end, or to now (or the job's end)."""
        if run.started_at is None:
            return None
        return max(0.0, min(run.ended_at or self.clock, self.clock) - run.started_at)

    def run_eta_s(self, run: RunView) -> float | None:
        """Seconds until the run trains its last step (None: unknown, ended early, or nothing runs)."""
        if run.state == "finished":
            return 0.0
        if run.state not in ("running", "waiting") or self.ended_at is not None:
            return None
        return eta_s(run.steps, run.max_steps, self.clock, run.started_at)

    @property
    def eta_s(self) -> float | None:
        """Until the last unfinished run should be done (None: one of them is unknown)."""
        if self.ended_at is not None:
            return None
        return job_eta_s(self.run_eta_s(run) for run in self.runs if run.state in ("running", "waiting"))

    @property
    def master_alive(self) -> bool:
        """Whether the job has a live master: one holds the folder's lease (a master that is
        starting or resuming holds it before it records its pid), or the recorded pid still runs
        (pid reuse aside; a lease on a filesystem without flock cannot be seen)."""
        if MasterLock.held(self.output_dir):
            return True
        try:
            return psutil.Process(self.master_pid).status() != psutil.STATUS_ZOMBIE if self.master_pid > 0 else False
        except psutil.Error:
            return False

    @property
    def master_gone(self) -> bool:
        """The job is not over but the master recorded as carrying it on is gone (a master killed
        with SIGKILL leaves RUNNING behind)."""
        live = (JobState.RUNNING, JobState.READY, JobState.INIT, JobState.STOPPING)
        return self.job_state in live and self.master_pid > 0 and not self.master_alive

    @property
    def trained_tokens(self) -> int:
        return sum(run.trained_tokens for run in self.runs)

    def trainer_tokens_per_s(self, window_s: float = THROUGHPUT_WINDOW_S) -> float | None:
        """Tokens the trainer trained per second, over all runs, in the newest `window_s`.

        Each run's log holds cumulative tokens; the trainer's rate is the sum of the runs'
        token increments inside the window, divided by the window actually covered.

        A log's rows are in time order (the trainer appends them), so each run's rows are walked
        back from the newest only as far as the window: the live view and the dashboard ask for
        this on every refresh, and a long run's log holds thousands of rows.
        """
        newest_per_run = (
            next((row["time"] for row in reversed(run.trainer_rows) if "time" in row), None) for run in self.runs
        )
        stamped = [at for at in newest_per_run if at is not None]
        if not stamped:
            return None
        newest = max(stamped)
        since = newest - window_s
        tokens, oldest = 0.0, newest
        for run in self.runs:
            last = base = None
            for row in reversed(run.trainer_rows):
                if "time" not in row or "total_tokens" not in row:
                    continue
                if last is None:
                    if row["time"] <= since:
                        break  # nothing inside the window
                    last = row
                # Without a row before the window, the run's first row is the baseline: its total
                # includes tokens trained at an unknown earlier time.
                base = row
                if row["time"] <= since:
                    break
            if last is None or base is None:
                continue
            tokens += last["total_tokens"] - base["total_tokens"]
            oldest = min(oldest, base["time"])
        span = newest - oldest
        return tokens / span if span > 0 else None


def _read_reason(path: Path, root: Path) -> str:
    try:
        return read_regular_text(path, within=root).strip()
    except OSError as error:
        return f"({path} unreadable: {error})"


def _pick(row: dict[str, float], names: tuple[str, ...]) -> float | None:
    for name in names:
        if name in row:
            return row[name]
    return None


def run_view(runs_dir: Path, entry: RunEntry) -> RunView:
    run = RunDir(runs_dir, entry.id)
    max_steps = int(entry.config.get("max_steps", 0))
    broadcasts = stable_steps(run.broadcast)
    trained = broadcasts[-1][0] if broadcasts else 0
    rows = read_progress_rows(run.root / "progress.csv")
    curve = [
        (row["step"], reward) for row in rows if "step" in row and (reward := _pick(row, REWARD_COLUMNS)) is not None
    ]
    view = RunView(entry.id, "running", trained, max_steps, curve=curve, settings=entry.config)
    if curve:
        view.reward = curve[-1][1]
    view.trainer_rows = read_progress_rows(run.root / "logs" / "trainer_progress.csv")
    view.evaluations = read_progress_rows(run.evaluations / "progress.csv")
    if view.trainer_rows:
        view.trained_tokens = int(view.trainer_rows[-1].get("total_tokens", 0))
    if rows:
        view.tokens_per_s = _pick(rows[-1], TOKENS_COLUMNS)
        view.policy_lag = _pick(rows[-1], LAG_COLUMNS)
        view.adapter_loads_s = [row[ADAPTER_LOAD_COLUMN] for row in rows if ADAPTER_LOAD_COLUMN in row]
        view.rollout_tokens_per_s = [rate for row in rows if (rate := _pick(row, TOKENS_COLUMNS)) is not None]
    if (rejected := rejection_reason(runs_dir.parent, entry.id)) is not None:
        view.state, view.reason = "rejected", rejected
    elif run.is_evicted():
        view.state, view.reason = "evicted", run.eviction_reason() or ""
    elif (unmarked := RunDir(runs_dir, entry.id).unwritten_eviction()) is not None:
        view.state, view.reason = "evicted", unmarked
    elif run.config_error.exists():
        view.state, view.reason = "rejected", _read_reason(run.config_error, run.root)
    elif run.is_finished():
        # Trained; a run with an evaluation ends when its orchestrator has evaluated the last step.
        evaluated = any(int(row.get("step", -1)) == max_steps for row in view.evaluations)
        view.state = "evaluating" if entry.config.get("evaluation") and not evaluated else "finished"
    elif not broadcasts:
        view.state = "waiting"
    view.started_at = _mtime(run.identity_file)
    view.ended_at = _ended_at(run, view, runs_dir)
    return view


def _mtime(path: Path) -> float | None:
    try:
        return os.lstat(path).st_mtime
    except OSError:
        return None


def _ended_at(run: RunDir, view: RunView, runs_dir: Path) -> float | None:
    """When the run ended: its marker's time (the one file that says it ended); None while it runs."""
    if view.state == "finished":
        return _mtime(run.finished)
    if view.state == "evicted":
        return _mtime(run.evicted) or _mtime(unwritten_eviction_path(runs_dir, run.run_id))
    if view.state == "rejected":
        return _mtime(runs_dir.parent / REJECTIONS_DIR / f"{view.run_id}.txt") or _mtime(run.config_error)
    return None


@contextlib.contextmanager
def open_job_store(output_dir: Path) -> Iterator[JobStore | None]:
    """The newest job's state (None: the store holds no job yet), read-only use; a file there that
    is not a SQLite database (or not a regular file: SQLite would block on a FIFO) is a one-line
    `ConfigError` naming it."""
    path = output_dir / STORE_FILE
    try:
        check_regular_file(path, MAX_STORE_BYTES)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no job state here (is this a job's output folder?)") from None
    except OSError as error:
        raise ConfigError(f"{path}: not a job state database ({error})") from None
    try:
        store = JobStore.latest(output_dir)
    except sqlite3.DatabaseError as error:
        raise ConfigError(f"{path}: not a job state database ({error})") from None
    try:
        yield store
    except sqlite3.DatabaseError as error:
        raise ConfigError(f"{path}: not a job state database ({error})") from None
    finally:
        if store is not None:
            store.close()


def read_job(output_dir: Path) -> tuple[JobRecord, list[NodeRecord]] | None:
    """The newest job recorded in `output_dir` and its nodes (None: no store, or no job in it)."""
    found = read_job_and_events(output_dir, 0)
    return None if found is None else found[:2]


def read_job_and_events(output_dir: Path, events: int) -> tuple[JobRecord, list[NodeRecord], list[LogRecord]] | None:
    """`read_job`, and the newest `events` transitions and decisions, oldest first."""
    if not os.path.lexists(output_dir / STORE_FILE):
        return None
    with open_job_store(output_dir) as job:
        if job is None:
            return None
        log = sorted([*job.transitions(), *job.decisions()], key=lambda r: r.at)[-events:] if events else []
        return job.job(), job.nodes(), log


ACTIVE_RUN_STATES = ("waiting", "running", "evaluating")
HELDOUT_COLUMNS = ("eval/accuracy_t0", "eval/reward_t0", "eval/return")


def _say_what_orchestrators_do(runs: list[RunView], nodes: list[NodeRecord]) -> None:
    """Each active run's `doing`, from its orchestrator node's heartbeat counters (`phase`)."""
    for node in nodes:
        # Orchestrator rank r serves entry r of the registry, the order of `runs`.
        if node.role != ORCHESTRATOR_ROLE or node.state != NodeState.RUNNING or not 0 <= node.rank < len(runs):
            continue
        run = runs[node.rank]
        if run.state in ACTIVE_RUN_STATES and "phase" in node.progress:
            engine = run.settings.get("inference", {}).get("engine", "hf")
            run.doing = describe(node.progress["phase"], node.progress.get("phase_step", 0), engine)


def collect(output_dir: Path, runs_dir: Path | None = None, events: int = 0) -> JobView:
    """The job as its files say it is now; with its newest `events` transitions and decisions."""
    runs_dir = runs_dir or output_dir / "runs"
    job_state, cause, created, master_pid, updated = "UNKNOWN", "", None, 0, None
    nodes: list[NodeRecord] = []
    log: list[LogRecord] = []
    if (found := read_job_and_events(output_dir, events)) is not None:
        record, nodes, log = found
        job_state, cause, created, master_pid = record.state, record.cause, record.created_at, record.master_pid
        updated = record.updated_at
    entries = read_registry(output_dir)
    runs = [run_view(runs_dir, entry) for entry in entries]
    _say_what_orchestrators_do(runs, nodes)
    rendezvous = rendezvous_summaries(output_dir)
    inference = read_inference(output_dir)
    try:
        rollout_runs = rollout_slots(entries)
    except ConfigError:  # configs parsed when they joined: only a hand-edited runs.json fails here
        rollout_runs = []
    return JobView(
        output_dir, job_state, cause, nodes, runs, time.time(), rendezvous, created, inference, master_pid, updated,
        rollout_runs, log,
    )  # fmt: skip
