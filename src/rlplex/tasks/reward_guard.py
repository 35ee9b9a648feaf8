"""Every reward call under a hard deadline, in a child process: one call that never returns
(math-verify on `\\boxed{9^{9^{9}}}` computes a huge integer holding the GIL) must not freeze the
process that scores, its heartbeat thread included.

Deadline rule: each row's call gets `deadline_s` seconds (default `DEFAULT_DEADLINE_S`; the
orchestrator's `reward_timeout_s`, set for a block with `reward_deadline`), counted from the end of
the row before it. A call past it is SIGKILLed with its worker and scores 0 ("timed out after X s",
in `safe_scores`' one warning per batch); the next row starts a fresh worker. A reward's imports
when it is unpickled, and those its `warm_up` attribute makes (math-verify's sympy and parsers:
`math_answer.warm_up`), are not counted (they get `_LOAD_DEADLINE_S`); imports it defers to its
first call are.

The worker: one per process, started on the first call and reused by every batch after it (a
lock makes concurrent batches take turns: rewards held the GIL in turn before anyway). It is a
fresh interpreter, never a fork of the multi-threaded scorer (`subprocess`: multiprocessing's
'spawn' would also re-run the parent's `__main__` script in it): it imports this module and the
reward's, not torch nor anything else the parent has loaded. It dies with its parent: at the end
of its pipe when idle, by `PR_SET_PDEATHSIG` (SIGKILL) when busy in a call that never returns. A
worker that dies in a call (killed from outside, e.g. by PR_SET_PDEATHSIG when the thread that
started it ended, or by the reward) is restarted and the row tried once more; twice on one row,
it scores 0.

The reward goes to the worker by pickle over the pipe (the process's own child: trusted), once a
batch; module-level functions and `Rubric`s of them pickle by reference. A reward that cannot
(a lambda, a closure) or that the worker cannot load (a function of the parent's `__main__`) runs
in this process without a deadline, with one warning: forking the scoring process instead would
copy its threads' locks (torch, the heartbeat) mid-use.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import numbers
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Literal, NamedTuple

log = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 10.0
# Starting a worker and unpickling the reward (its module's imports: torch could be one) on a busy machine.
_LOAD_DEADLINE_S = 120.0
_REAP_S = 10.0  # a SIGKILLed process is gone in milliseconds; this only bounds a stuck kernel
_BOOT = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from rlplex.tasks.reward_guard import serve; serve(int(sys.argv[2]), int(sys.argv[3]))"
)

Reward = Callable[[str, str, str], float]
Row = tuple[str, str, str]  # prompt text, completion, answer


class RowFailure(NamedTuple):
    """Why a row scores 0: `text` completes "row N: ..." in the batch's warning."""

    kind: Literal["raised", "returned", "timed out", "died", "unloadable"]
    text: str


Outcome = float | RowFailure


@dataclass
class RewardTally:
    """What the reward calls of one `reward_deadline` block did: rows scored, rows timed out."""

    deadline_s: float
    rows: int = 0
    timed_out: int = 0
    reward: str | None = None  # the reward that timed out (its module:name)

    @property
    def mostly_timed_out(self) -> bool:
        """At least half of the rows timed out: the reward, not the policy, decided the batch."""
        return self.timed_out > 0 and 2 * self.timed_out >= self.rows


_deadline: ContextVar[float] = ContextVar("reward_deadline", default=DEFAULT_DEADLINE_S)
_tally: ContextVar[RewardTally | None] = ContextVar("reward_tally", default=None)


@contextmanager
def reward_deadline(seconds: float) -> Iterator[RewardTally]:
    """Reward calls made in this block (this thread) get `seconds` each; yields their tally."""
    tally = RewardTally(seconds)
    deadline, counted = _deadline.set(seconds), _tally.set(tally)
    try:
        yield tally
    finally:
        _tally.reset(counted)
        _deadline.reset(deadline)


def describe(reward: object) -> str:
    """`module:name` of a function, else of the callable's class."""
    module, name = getattr(reward, "__module__", None), getattr(reward, "__qualname__", None)
    if isinstance(module, str) and isinstance(name, str):
        return f"{module}:{name}"
    return f"{type(reward).__module__}:{type(reward).__qualname__}"


def score_row(reward: Reward, prompt: str, completion: str, answer: str) -> Outcome:
    """One call of the reward: a finite float, or why the row scores 0."""
    try:
        value = reward(prompt, completion, answer)
    except Exception as error:  # any failure of user code is the sample's, not the run's
        return RowFailure("raised", f"raised {error!r}")
    try:
        if isinstance(value, numbers.Real) and math.isfinite(number := float(value)):
            return number
    except (OverflowError, ValueError):  # an integer too large for a float
        pass
    return RowFailure("returned", f"returned {value!r:.80}")


def warm_up(reward: object) -> None:
    """Run the `warm_up` a reward (or each function of a `Rubric`) declares: its lazy imports, under
    the load deadline rather than the first row's (a fresh worker after a timeout pays them again)."""
    from rlplex.tasks.environment import Rubric

    parts = [function for function, _ in reward.functions] if isinstance(reward, Rubric) else []
    for function in [reward, *parts]:
        hook = getattr(function, "warm_up", None)
        if callable(hook):
            try:
                hook()
            except Exception:  # the row's own call will fail the same way and say so
                pass


def serve(fd: int, parent_pid: int) -> None:
    """The worker's loop: a batch in, a readiness message, then one outcome per row."""
    from rlplex.processes import die_with_parent

    # Ctrl-C in a terminal reaches the whole process group; the parent decides, the worker follows it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL, parent_pid)
    conn = Connection(fd)
    try:
        while True:
            path, blob, rows = conn.recv()
            if path is not None:
                sys.path[:] = path
            try:
                reward = pickle.loads(blob)
            except Exception as error:  # a missing module or attribute: the parent runs it itself
                conn.send(RowFailure("unloadable", f"{error!r:.200}"))
                continue
            warm_up(reward)
            conn.send(None)  # loaded: the first row's deadline starts now
            for prompt, completion, answer in rows:
                conn.send(score_row(reward, prompt, completion, answer))
    except (EOFError, OSError):  # the parent closed its end or is gone: so is the work
        return


def _search_path() -> list[str]:
    # The worker does not share the parent's working directory changes: absolute entries only.
    return [os.path.abspath(entry) if entry else os.getcwd() for entry in sys.path]


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.path = _search_path()
        conn, child_end = Pipe()
        try:
            argv = [sys.executable, "-c", _BOOT, json.dumps(self.path), str(child_end.fileno()), str(self.owner)]
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, pass_fds=(child_end.fileno(),))
        except BaseException:
            conn.close()
            raise
        finally:
            child_end.close()
        self.conn = conn

    def alive(self) -> bool:
        return self.process.poll() is None

    def start(self, blob: bytes, rows: Sequence[Row]) -> RowFailure | None:
        """Send a batch; None once the worker has loaded the reward, else why not."""
        path = _search_path()
        try:
            self.conn.send((path if path != self.path else None, blob, list(rows)))
        except OSError:  # it died before the request: BrokenPipeError
            return self._died()
        self.path = path
        reply = self.receive(_LOAD_DEADLINE_S)
        if isinstance(reply, RowFailure) and reply.kind == "timed out":
            return RowFailure("timed out", f"did not load in the reward worker within {_LOAD_DEADLINE_S:g} s")
        return reply if isinstance(reply, RowFailure) else None

    def receive(self, timeout: float) -> Outcome | RowFailure | None:
        try:
            if not self.conn.poll(timeout):
                return RowFailure("timed out", f"timed out after {timeout:g} s")
            reply: Outcome | None = self.conn.recv()
        except (EOFError, OSError):
            return self._died()
        return reply

    def _died(self) -> RowFailure:
        try:
            code: int | None = self.process.wait(timeout=_REAP_S)
        except subprocess.TimeoutExpired:
            code = None
        return RowFailure("died", f"ended the reward worker process (exit code {code})")

    def stop(self) -> None:
        self.conn.close()
        if self.owner != os.getpid():
            return  # a fork's copy: the process is the parent's child, not ours
        self.process.kill()
        try:
            self.process.wait(timeout=_REAP_S)
        except subprocess.TimeoutExpired:
            log.warning("reward worker %d did not end %g s after SIGKILL", self.process.pid, _REAP_S)


class RewardGuard:
    """Runs reward calls in its worker process, each under a deadline (see the module docstring)."""

    def __init__(self) -> None:
        self._batch = threading.Lock()  # one batch at a time uses the worker
        self._state = threading.Lock()  # guards `_worker`: `close` may come from another thread
        self._worker: _Worker | None = None
        self._warned: set[str] = set()

    @property
    def pid(self) -> int | None:
        worker = self._worker
        return worker.process.pid if worker is not None else None

    def outcomes(self, reward: Reward, rows: Sequence[Row], deadline_s: float) -> list[Outcome]:
        """One outcome per row: its score, or why it scores 0 (raised, returned no number, timed out)."""
        try:
            blob = pickle.dumps(reward)
        except Exception as error:  # pickle raises several types for a lambda or a closure
            return self._in_process(reward, rows, f"it cannot be pickled ({error!r:.120})")
        with self._batch:
            results: list[Outcome] = []
            died_on: int | None = None  # the row whose call a worker died in
            while len(results) < len(rows):
                pending = rows[len(results) :]
                try:
                    worker = self._live_worker()
                except OSError as error:  # no interpreter to start: nothing guards the call
                    return results + self._in_process(reward, pending, f"no worker process starts ({error!r:.120})")
                failure = worker.start(blob, pending)
                if failure is not None and failure.kind == "unloadable":
                    return results + self._in_process(reward, pending, f"the worker cannot load it ({failure.text})")
                if failure is not None and failure.kind == "timed out":  # its loading hangs: so would every row's
                    self._stop(worker)
                    return results + [failure] * len(pending)
                if failure is None:
                    failure = self._receive(worker, len(pending), deadline_s, results)
                if failure is None:
                    break
                self._stop(worker)
                if failure.kind == "died" and died_on != len(results):
                    died_on = len(results)  # perhaps killed from outside: the row gets one more try
                    continue
                results.append(failure)
        return results

    @staticmethod
    def _receive(worker: _Worker, count: int, deadline_s: float, results: list[Outcome]) -> RowFailure | None:
        """Append up to `count` rows' outcomes; the timeout or death that stopped it, if one did."""
        for _ in range(count):
            outcome = worker.receive(deadline_s)
            if outcome is None:
                return RowFailure("died", "broke the reward worker's protocol")
            if isinstance(outcome, RowFailure) and outcome.kind in ("timed out", "died"):
                return outcome
            results.append(outcome)
        return None

    def _live_worker(self) -> _Worker:
        with self._state:
            if self._worker is not None and (self._worker.owner != os.getpid() or not self._worker.alive()):
                self._worker.stop()
                self._worker = None
            if self._worker is None:
                self._worker = _Worker()
            return self._worker

    def _stop(self, worker: _Worker) -> None:
        with self._state:
            if self._worker is worker:
                self._worker = None
        worker.stop()

    def _in_process(self, reward: Reward, rows: Sequence[Row], why: str) -> list[Outcome]:
        name = describe(reward)
        if name not in self._warned:
            self._warned.add(name)
            log.warning(
                "reward %s runs in this process, without a deadline: %s; a call that never returns "
                "stops this process (define the reward at module level to guard it)",
                name,
                why,
            )
        return [score_row(reward, *row) for row in rows]

    def close(self) -> None:
        """Stop the worker, busy or not; a later call starts a new one."""
        with self._state:
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()

    def forget(self) -> None:
        """In a forked child: drop the parent's worker without touching it."""
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.conn.close()


_guard: RewardGuard | None = None
_guard_lock = threading.Lock()


def process_guard() -> RewardGuard:
    """This process's guard, made on first use and closed at exit."""
    global _guard
    with _guard_lock:
        if _guard is None:
            _guard = RewardGuard()
            atexit.register(_guard.close)
        return _guard


def _after_fork() -> None:
    # A fork (the tests' orchestrators) must not talk to its parent's worker over the shared pipe.
    global _guard, _guard_lock
    _guard_lock = threading.Lock()
    if _guard is not None:
        _guard.forget()
    _guard = None


os.register_at_fork(after_in_child=_after_fork)


def guarded_outcomes(reward: Reward, rows: Sequence[Row]) -> list[Outcome]:
    """`RewardGuard.outcomes` on this process's guard, with the deadline of the current
    `reward_deadline` block (else the default), counted in its tally."""
    tally = _tally.get()
    outcomes = process_guard().outcomes(reward, rows, _deadline.get())
    if tally is not None:
        timed_out = sum(1 for o in outcomes if isinstance(o, RowFailure) and o.kind == "timed out")
        tally.rows += len(outcomes)
        tally.timed_out += timed_out
        if timed_out:
            tally.reward = describe(reward)
    return outcomes


__all__ = [
    "DEFAULT_DEADLINE_S",
    "Outcome",
    "RewardGuard",
    "RewardTally",
    "RowFailure",
    "describe",
    "guarded_outcomes",
    "process_guard",
    "reward_deadline",
    "score_row",
]
