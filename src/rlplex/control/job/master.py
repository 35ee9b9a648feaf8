"""`PrimeMaster`: the user's handle on a job, as in the seed.

    master = PrimeMaster.create(spec_or_toml)   # store + job token + backend; nothing runs yet
    master.start()                              # PrimeManager.prepare() then start()
    master.wait()                               # monitor() until the drivers finish / the job fails
    master.stop()

`PrimeMaster.resume(output_dir)` is master failover: a new master process reloads the job from
`<output_dir>/job.sqlite`, re-attaches to the nodes that are alive (they kept running in
their own sessions), restarts the lost ones and goes on. The job token (HMAC key of every
control connection) lives in `<output_dir>/job.token`, readable by the owner only.

One master per job folder: every master (`create`, `resume`, the Ray master actor through
them) holds an exclusive `flock` on `<output_dir>/master.lock` for its whole life; a second
one is refused with `MasterRunningError` naming the live one. The kernel drops the lock when
the master's process dies however it dies, so a resumed master never waits for a stale lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from rlplex.control.backends.scheduler import Scheduler
from rlplex.control.job.health import FailurePolicy
from rlplex.control.job.manager import PrimeManager
from rlplex.control.job.spec import JobSpec, load_job, parse_job
from rlplex.control.job.states import TERMINAL_JOB_STATES, JobState, job_outcome
from rlplex.control.job.stop_request import clear_stop_request, request_stop, stop_requested, wait_for_stop
from rlplex.control.job.store import JobRecord, SqliteStateStore
from rlplex.control.job.token import read_token, write_token
from rlplex.control.node.slot import NodeInfo
from rlplex.errors import ConfigError, JobFailedError, JobSpecError, MasterRunningError, WaitTimeoutError

LOCK_FILE = "master.lock"


class MasterLock:
    """The lease of the one master of a job folder: an exclusive flock on `<output_dir>/master.lock`.

    The file also says who holds it (pid, host, since), for the message that refuses a second master."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, output_dir: Path) -> MasterLock:
        path = output_dir / LOCK_FILE
        # os.open's descriptors are not inherited: node processes must not hold the master's lease.
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "holder unknown"
            os.close(fd)
            raise MasterRunningError(
                f"{output_dir}: this job folder already has a live master ({holder}); "
                f"watch it with 'rlplex job status {output_dir}', or stop it before starting another"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {since}\n".encode(), 0)
        return cls(fd, path)

    @staticmethod
    def held(output_dir: Path) -> bool:
        """Whether a live master holds the job folder's lease. Unlike its recorded pid, this is
        true from the moment a starting or resuming master takes the lease."""
        try:
            fd = os.open(output_dir / LOCK_FILE, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        finally:
            os.close(fd)  # also drops the shared lock, if it was granted
        return False

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


BACKEND_ENV, RAY_ADDRESS_ENV = "RLPLEX_BACKEND", "RLPLEX_RAY_ADDRESS"


def backend_overrides(backend: str | None = None, ray_address: str | None = None) -> dict[str, str]:
    """Where the job runs, by precedence: the job file < RLPLEX_BACKEND / RLPLEX_RAY_ADDRESS < arguments (flags)."""
    out: dict[str, str] = {}
    for key, env, value in (("backend", BACKEND_ENV, backend), ("ray_address", RAY_ADDRESS_ENV, ray_address)):
        chosen = value if value is not None else os.environ.get(env) or None
        if chosen is not None:
            out[key] = chosen
    return out


def make_scheduler(spec: JobSpec, job_id: str, token: bytes) -> Scheduler:
    if spec.backend == "local":
        from rlplex.control.backends.local import LocalScheduler

        return LocalScheduler(spec.output_dir, job_id, token, spec.rpc_timeout_s, spec.preload)
    if spec.backend == "ray":
        try:
            from rlplex.control.backends.ray import RayScheduler
        except ImportError as error:
            raise JobSpecError(f"job '{spec.name}': field 'backend': 'ray' needs Ray installed ({error})") from None
        return RayScheduler(spec, job_id, token, spec.rpc_timeout_s)
    raise JobSpecError(f"job '{spec.name}': field 'backend': unknown backend '{spec.backend}'")


def _open_resumable(output_dir: Path) -> tuple[SqliteStateStore, str, JobState, JobSpec]:
    """The store, latest job id, state and spec of the unfinished job in `output_dir`."""
    store = SqliteStateStore.in_dir(output_dir, create=False)
    try:
        job_id = store.latest_job_id()
        if job_id is None:
            raise ConfigError(f"{output_dir}: no job to resume")
        record = store.job(job_id)
        if JobState(record.state) in TERMINAL_JOB_STATES:
            raise ConfigError(f"{output_dir}: job {job_id} is already {record.state}; nothing to resume")
        data = json.loads(record.spec_json) | {"output_dir": str(output_dir)}
        spec = parse_job(data, f"job '{record.name}' in {output_dir}")
    except BaseException:
        store.close()
        raise
    return store, job_id, JobState(record.state), spec


def resumable_spec(output_dir: str | Path) -> JobSpec:
    """The spec of the unfinished job in `output_dir` (absolute), for a driver that resumes it elsewhere.

    Raises ConfigError when there is no job there or it has already ended."""
    store, _, _, spec = _open_resumable(Path(output_dir).resolve())
    store.close()
    return spec


class PrimeMaster:
    def __init__(self, manager: PrimeManager, store: SqliteStateStore, lock: MasterLock | None = None) -> None:
        self.manager, self.store, self.lock = manager, store, lock

    @property
    def job_id(self) -> str:
        return self.manager.job_id

    @property
    def state(self) -> JobState:
        return self.manager.job.state

    @classmethod
    def create(
        cls,
        config: JobSpec | str | Path,
        policy: FailurePolicy | None = None,
        backend: str | None = None,
        ray_address: str | None = None,
    ) -> PrimeMaster:
        """`backend` / `ray_address` (else RLPLEX_BACKEND / RLPLEX_RAY_ADDRESS) override the job file's."""
        spec = config if isinstance(config, JobSpec) else load_job(config)
        updates: dict[str, str] = {
            "output_dir": str(spec.output_dir.resolve()),
            **backend_overrides(backend, ray_address),
        }
        spec = parse_job(spec.model_dump(mode="json") | updates, f"job '{spec.name}'")
        spec.output_dir.mkdir(parents=True, exist_ok=True)
        # The lease first: a live job's token, store and nodes must stay untouched by a second `run`.
        lock = MasterLock.acquire(spec.output_dir)
        try:
            token = write_token(spec.output_dir)
            clear_stop_request(spec.output_dir)  # one left by an earlier job in this folder is not for this one
            store = SqliteStateStore.in_dir(spec.output_dir)
            job_id = f"{spec.name}-{uuid.uuid4().hex[:8]}"
            store.create_job(job_id, spec.name, spec.model_dump_json())
            scheduler = make_scheduler(spec, job_id, token)
            store.set_master(job_id, scheduler.master_address, os.getpid())
            return cls(PrimeManager(spec, job_id, store, scheduler, policy), store, lock)
        except BaseException:
            lock.release()
            raise

    @classmethod
    def resume(cls, output_dir: str | Path, policy: FailurePolicy | None = None) -> PrimeMaster:
        output_dir = Path(output_dir).resolve()
        store, job_id, state, spec = _open_resumable(output_dir)
        try:
            lock = MasterLock.acquire(output_dir)
        except BaseException:
            store.close()
            raise
        try:
            scheduler = make_scheduler(spec, job_id, read_token(output_dir))
            manager = PrimeManager(spec, job_id, store, scheduler, policy, state=state)
            manager.reattach()
            # Named only now: a process of an incarnation that reattach() replaced must find this
            # master after the store says it is stale (it checks on every reconnect), never before.
            store.set_master(job_id, scheduler.master_address, os.getpid())
        except BaseException:
            store.close()
            lock.release()
            raise
        return cls(manager, store, lock)

    def start(self) -> None:
        """prepare() (place, create, check every node) then start(); raises if prepare fails."""
        if self.state == JobState.INIT:
            self.manager.prepare()
        if self.state == JobState.READY and not self.manager.failover_pending:
            self.manager.start()

    def wait(
        self, timeout: float | None = None, raise_on_failure: bool = True, on_tick: Callable[[], None] | None = None
    ) -> JobState:
        """Run the control loop until the job ends; FAILED raises `JobFailedError` with the cause.
        `on_tick` runs after each pass of the loop (a caller's progress line or log tail)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        interval = self.manager.spec.monitor_interval_s
        while self.manager.monitor() not in TERMINAL_JOB_STATES:
            if self.stop_if_requested():
                break
            if on_tick is not None:
                on_tick()
            if deadline is not None and time.monotonic() > deadline:
                raise WaitTimeoutError(f"job {self.job_id} still {self.state.value} after {timeout} s")
            time.sleep(interval)
        if on_tick is not None:
            on_tick()
        if self.state == JobState.FAILED and raise_on_failure:
            raise JobFailedError(f"job {self.job_id} failed: {self.store.job(self.job_id).cause}")
        return self.state

    def monitor(self) -> JobState:
        return self.manager.monitor()

    @property
    def cause(self) -> str:
        """Why the job is in its state: the cause of its last transition."""
        return next((r.cause for r in reversed(self.store.transitions(self.job_id)) if r.entity == "job"), "")

    def stop(self, cause: str = "stopped by the user") -> None:
        self.manager.stop(cause)

    def stop_if_requested(self) -> bool:
        """Stop the job if `rlplex job stop` asked for it (see `stop_request`); whether it did."""
        output_dir = self.manager.spec.output_dir
        reason = stop_requested(output_dir)
        if reason is None:
            return False
        self.stop(reason)
        clear_stop_request(output_dir)  # last: the asker waits for it to go
        return True

    def close(self) -> None:
        try:
            self.manager.close()
            self.store.close()
        finally:
            if self.lock is not None:
                self.lock.release()

    def get_nodes_by_role(self) -> dict[str, list[NodeInfo]]:
        return self.manager.get_nodes_by_role()

    def scale_role(self, role: str, count: int) -> None:
        self.manager.scale_role(role, count)

    def __enter__(self) -> PrimeMaster:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self.stop("master closed" if error is None else f"master closed after {error!r}")
        finally:
            self.close()


def _latest_job(output_dir: Path) -> JobRecord | None:
    store = SqliteStateStore.in_dir(output_dir, create=False)
    try:
        job_id = store.latest_job_id()
        return store.job(job_id) if job_id is not None else None
    finally:
        store.close()


def stop_job(output_dir: Path, timeout_s: float = 60.0) -> str:
    """What `rlplex job stop` does: ask the job's master to stop the job and wait until it has; a
    local job whose master died is taken over and stopped here. What happened, in one line."""
    output_dir = Path(output_dir).resolve()
    record = _latest_job(output_dir)
    if record is None:
        return f"{output_dir}: no job"
    if JobState(record.state) in TERMINAL_JOB_STATES:
        return f"{output_dir}: job {record.job_id} is {record.state}; nothing to stop"
    if MasterLock.held(output_dir):
        request = request_stop(output_dir, "stopped by `rlplex job stop`")
        wait_for_stop(request, timeout_s, lambda: MasterLock.held(output_dir))
    elif json.loads(record.spec_json).get("backend") == "ray":
        raise ConfigError(
            f"{output_dir}: job {record.job_id} has no live master; take it over with `rlplex job resume`"
        )
    else:
        master = PrimeMaster.resume(output_dir)
        try:
            master.stop("stopped by `rlplex job stop` (its master was gone)")
        finally:
            master.close()
    ended = _latest_job(output_dir)
    return f"job {record.job_id}: {job_outcome(ended.state, ended.cause) if ended is not None else 'UNKNOWN'}"


def drive(master: PrimeMaster, say: Callable[[str], None], on_tick: Callable[[], None] | None = None) -> JobState:
    """What a command that owns a master does: start the job (unless a resumed master is mid-way
    through failover), say where to watch it, run the control loop to the end and say how it
    ended. The job is stopped and the master closed on the way out, whatever ends the wait (a
    failure, Ctrl-C); FAILED raises `JobFailedError`."""
    try:
        if master.state in (JobState.INIT, JobState.READY) and not master.manager.failover_pending:
            master.start()
        say(f"job {master.job_id}: {master.state.value}; status: rlplex job status {master.manager.spec.output_dir}")
        master.wait(on_tick=on_tick, raise_on_failure=False)
    except KeyboardInterrupt as interrupt:  # Ctrl-C, or a signal that `stop_signals_as_interrupt` raised as one
        master.stop(f"stopped by {signal.Signals(getattr(interrupt, 'signum', signal.SIGINT)).name}")
        raise
    finally:
        master.stop("master exiting")
        state, cause = master.state, master.cause
        master.close()
        say(f"job {master.job_id}: {job_outcome(state, cause)}")
    if state == JobState.FAILED:
        raise JobFailedError(f"job {master.job_id} failed: {cause}")
    return state
