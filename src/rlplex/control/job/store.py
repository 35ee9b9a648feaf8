"""The job's state, kept transactionally: `StateStore` protocol and the SQLite implementation.

`<output_dir>/job.sqlite` (WAL mode on a local disk, so `rlplex job status` and the nodes read
while the master writes; a rollback journal on a network filesystem, see `journal_mode_for`)
holds, keyed by job id: the job row (spec JSON, state, restarts, cause, the master's address),
one row per node, the restarts spent per role, every state transition with time and cause, and
every failure decision with its cause. A restarted master rebuilds itself from these rows alone.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rlplex.control.job.states import JobState, NodeState

STORE_FILE = "job.sqlite"
JOURNAL_ENV = "RLPLEX_SQLITE_JOURNAL"
# Filesystems whose files other machines (or a user-space daemon) serve: WAL's shared-memory
# index cannot work across machines on them (see `journal_mode_for`).
NETWORK_FS_TYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "afs", "9p", "lustre", "gpfs", "ceph", "glusterfs",
    "beegfs", "ocfs2", "gfs2", "virtiofs",
})  # fmt: skip

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, name TEXT, spec_json TEXT, state TEXT, restarts INTEGER DEFAULT 0,
    cause TEXT DEFAULT '', master_address TEXT DEFAULT '', master_pid INTEGER DEFAULT 0,
    created_at REAL, updated_at REAL);
CREATE TABLE IF NOT EXISTS nodes (
    job_id TEXT, node_id TEXT, role TEXT, rank INTEGER, state TEXT, pid INTEGER DEFAULT 0,
    create_time REAL DEFAULT 0, address TEXT DEFAULT '', restarts INTEGER DEFAULT 0,
    incarnation INTEGER DEFAULT 0, last_heartbeat REAL DEFAULT 0, progress_json TEXT DEFAULT '{}',
    cause TEXT DEFAULT '', PRIMARY KEY (job_id, node_id));
CREATE TABLE IF NOT EXISTS roles (
    job_id TEXT, role TEXT, restarts INTEGER DEFAULT 0, PRIMARY KEY (job_id, role));
CREATE TABLE IF NOT EXISTS transitions (
    id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT, entity TEXT, old TEXT, new TEXT, cause TEXT, at REAL);
CREATE TABLE IF NOT EXISTS decisions (
    id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT, action TEXT, target TEXT, cause TEXT, at REAL);
"""


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    name: str
    spec_json: str
    state: str
    restarts: int
    cause: str
    master_address: str
    master_pid: int
    created_at: float
    updated_at: float


@dataclass(frozen=True)
class NodeRecord:
    job_id: str
    node_id: str
    role: str
    rank: int
    state: str
    pid: int
    create_time: float
    address: str
    restarts: int
    incarnation: int
    last_heartbeat: float
    progress_json: str
    cause: str

    @property
    def progress(self) -> dict[str, Any]:
        return dict(json.loads(self.progress_json or "{}"))


@dataclass(frozen=True)
class LogRecord:
    """A transition (entity, old -> new) or a decision (entity = target, old = action)."""

    entity: str
    old: str
    new: str
    cause: str
    at: float


class StateStore(Protocol):
    def transaction(self) -> AbstractContextManager[Any]:
        """One atomic unit: every write inside (also through the methods below) commits together or not at all."""
        ...

    def create_job(self, job_id: str, name: str, spec_json: str) -> None: ...
    def job(self, job_id: str) -> JobRecord: ...
    def latest_job_id(self) -> str | None: ...
    def record_transition(self, job_id: str, entity: str, old: str, new: str, cause: str) -> None: ...
    def set_master(self, job_id: str, address: str, pid: int) -> None: ...
    def add_node(self, job_id: str, node_id: str, role: str, rank: int, state: str) -> None: ...
    def update_node(self, job_id: str, node_id: str, **fields: Any) -> None: ...
    def update_heartbeats(self, job_id: str, rows: Sequence[tuple[str, float, dict[str, Any]]]) -> None: ...
    def nodes(self, job_id: str) -> list[NodeRecord]: ...
    def spend_restart(self, job_id: str, role: str) -> tuple[int, int]: ...
    def role_restarts(self, job_id: str) -> dict[str, int]: ...
    def record_decision(self, job_id: str, action: str, target: str, cause: str) -> None: ...
    def transitions(self, job_id: str) -> list[LogRecord]: ...
    def decisions(self, job_id: str) -> list[LogRecord]: ...
    def close(self) -> None: ...


_NODE_FIELDS = frozenset(
    {"pid", "create_time", "address", "restarts", "incarnation", "last_heartbeat", "progress_json", "cause"}
)


def _unescape_mount(field: str) -> str:
    # /proc/mounts writes a space, tab, newline and backslash of a path as octal escapes.
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def mount_fstype(path: str | Path, mounts: str) -> str:
    """The filesystem type of the mount holding `path` (the longest mount point that is a prefix
    of it), read from `mounts` in /proc/mounts' format; "" when no line matches."""
    target = os.path.realpath(path)
    best, fstype = -1, ""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = _unescape_mount(fields[1])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:  # a later line of equal length mounts over an earlier one
            best, fstype = len(point), fields[2]
        elif inside and len(point) == best:
            fstype = fields[2]
    return fstype


def is_network_fs(fstype: str) -> bool:
    """NFS, SMB, Lustre, ... and every FUSE filesystem (sshfs, s3fs, gcsfuse: none offers shared mmap)."""
    return fstype in NETWORK_FS_TYPES or fstype == "fuse" or fstype.startswith("fuse.")


def journal_mode_for(path: str | Path, mounts: str | None = None, override: str | None = None) -> str:
    """WAL on a local disk, DELETE (the rollback journal) on a network filesystem; `override` or
    RLPLEX_SQLITE_JOURNAL decides first.

    SQLite's WAL keeps its index in a shared-memory file mapped by every connection, so "all
    processes using a database must be on the same host computer; WAL does not work over a
    network filesystem" (https://www.sqlite.org/wal.html, Disadvantages). A multi-machine Ray
    job has its store on a shared filesystem: there the rollback journal (DELETE) with the
    filesystem's POSIX locks is what SQLite supports. Where machines see one folder through
    different filesystems (a head's local disk exported over NFS), set RLPLEX_SQLITE_JOURNAL=delete
    on every machine (node actors inherit the master's RLPLEX_* variables)."""
    chosen = override if override is not None else os.environ.get(JOURNAL_ENV, "")
    if chosen:
        mode = chosen.strip().lower()
        if mode not in ("wal", "delete"):
            from rlplex.errors import ConfigError

            raise ConfigError(
                f"{JOURNAL_ENV}: {chosen!r} is not a journal mode rlplex uses (expected 'wal' or 'delete')"
            )
        return mode
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return "wal"  # not Linux: no way to tell; the common case is a local disk
    return "delete" if is_network_fs(mount_fstype(path, mounts)) else "wal"


class SqliteStateStore:
    """`StateStore` on one SQLite file. Safe to share between threads of one process (one lock)."""

    def __init__(self, path: str | Path, create: bool = True) -> None:
        self.path = Path(path)
        if not create and not self.path.exists():
            from rlplex.errors import ConfigError

            raise ConfigError(f"{self.path}: no job state here (is this a job's output folder?)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: we open every transaction ourselves with BEGIN IMMEDIATE.
        self._db = sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=False)
        self._lock = threading.RLock()
        self._depth = 0  # nesting of transaction() in the thread that holds the lock
        self.journal_mode = journal_mode_for(self.path.parent)
        self._db.execute(f"PRAGMA journal_mode={self.journal_mode.upper()}")
        # In WAL mode NORMAL never corrupts, and avoids an fsync per heartbeat flush; the
        # rollback journal needs FULL for that.
        self._db.execute(f"PRAGMA synchronous={'NORMAL' if self.journal_mode == 'wal' else 'FULL'}")
        # Also when only reading: a reader racing a new job's master must see empty tables, not none.
        self._db.executescript(_SCHEMA)

    @classmethod
    def in_dir(cls, output_dir: str | Path, create: bool = True) -> SqliteStateStore:
        return cls(Path(output_dir) / STORE_FILE, create=create)

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT; nested calls join the outermost one, so that a caller can make
        several of the methods below (a restart decision: decision, budget, node states) one unit."""
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield self._db
                finally:
                    self._depth -= 1
                return
            self._db.execute("BEGIN IMMEDIATE")
            self._depth = 1
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            finally:
                self._depth = 0
            self._db.execute("COMMIT")

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return list(self._db.execute(sql, args).fetchall())

    def create_job(self, job_id: str, name: str, spec_json: str) -> None:
        now = time.time()
        with self.transaction() as db:
            db.execute(
                "INSERT INTO jobs (job_id, name, spec_json, state, created_at, updated_at) VALUES (?,?,?,?,?,?)",
                (job_id, name, spec_json, JobState.INIT.value, now, now),
            )

    def job(self, job_id: str) -> JobRecord:
        rows = self._query(
            "SELECT job_id, name, spec_json, state, restarts, cause, master_address, master_pid, created_at, "
            "updated_at FROM jobs WHERE job_id = ?",
            (job_id,),
        )
        if not rows:
            from rlplex.errors import ConfigError

            raise ConfigError(f"{self.path}: no job with id '{job_id}'")
        return JobRecord(*rows[0])

    def latest_job_id(self) -> str | None:
        rows = self._query("SELECT job_id FROM jobs ORDER BY created_at DESC LIMIT 1")
        return str(rows[0][0]) if rows else None

    def record_transition(self, job_id: str, entity: str, old: str, new: str, cause: str) -> None:
        now = time.time()
        with self.transaction() as db:
            if entity == "job":
                # A job's cause is why it ended (FINISHED or STOPPED by whom, or FAILED: `job_outcome`);
                # a failover's steps on the way keep the cause of the failure that started it.
                db.execute(
                    "UPDATE jobs SET state = ?, cause = CASE WHEN ? IN ('FAILED', 'STOPPED') THEN ? ELSE cause END, "
                    "updated_at = ? WHERE job_id = ?",
                    (new, new, cause, now, job_id),
                )
            else:
                db.execute(
                    "UPDATE nodes SET state = ?, cause = ? WHERE job_id = ? AND node_id = ?",
                    (new, cause, job_id, entity),
                )
            db.execute(
                "INSERT INTO transitions (job_id, entity, old, new, cause, at) VALUES (?,?,?,?,?,?)",
                (job_id, entity, old, new, cause, now),
            )

    def set_master(self, job_id: str, address: str, pid: int) -> None:
        with self.transaction() as db:
            db.execute("UPDATE jobs SET master_address = ?, master_pid = ? WHERE job_id = ?", (address, pid, job_id))

    def add_node(self, job_id: str, node_id: str, role: str, rank: int, state: str) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO nodes (job_id, node_id, role, rank, state) VALUES (?,?,?,?,?)",
                (job_id, node_id, role, rank, state),
            )
            db.execute("INSERT OR IGNORE INTO roles (job_id, role) VALUES (?, ?)", (job_id, role))

    def update_node(self, job_id: str, node_id: str, **fields: Any) -> None:
        unknown = set(fields) - _NODE_FIELDS
        if unknown:
            raise ValueError(f"update_node: unknown node fields {sorted(unknown)}")
        columns = ", ".join(f"{name} = ?" for name in fields)
        with self.transaction() as db:
            db.execute(
                f"UPDATE nodes SET {columns} WHERE job_id = ? AND node_id = ?", (*fields.values(), job_id, node_id)
            )

    def update_heartbeats(self, job_id: str, rows: Sequence[tuple[str, float, dict[str, Any]]]) -> None:
        if not rows:
            return
        with self.transaction() as db:
            db.executemany(
                "UPDATE nodes SET last_heartbeat = ?, progress_json = ? WHERE job_id = ? AND node_id = ?",
                [(at, json.dumps(progress), job_id, node_id) for node_id, at, progress in rows],
            )

    def nodes(self, job_id: str) -> list[NodeRecord]:
        rows = self._query(
            "SELECT job_id, node_id, role, rank, state, pid, create_time, address, restarts, incarnation, "
            "last_heartbeat, progress_json, cause FROM nodes WHERE job_id = ? ORDER BY role, rank",
            (job_id,),
        )
        return [NodeRecord(*row) for row in rows]

    def spend_restart(self, job_id: str, role: str) -> tuple[int, int]:
        """Count one restart against `role` and the job; returns (role restarts, job restarts)."""
        with self.transaction() as db:
            db.execute("INSERT OR IGNORE INTO roles (job_id, role) VALUES (?, ?)", (job_id, role))
            db.execute("UPDATE roles SET restarts = restarts + 1 WHERE job_id = ? AND role = ?", (job_id, role))
            db.execute("UPDATE jobs SET restarts = restarts + 1 WHERE job_id = ?", (job_id,))
            role_n = db.execute("SELECT restarts FROM roles WHERE job_id = ? AND role = ?", (job_id, role)).fetchone()
            job_n = db.execute("SELECT restarts FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return int(role_n[0]), int(job_n[0])

    def role_restarts(self, job_id: str) -> dict[str, int]:
        return {str(r): int(n) for r, n in self._query("SELECT role, restarts FROM roles WHERE job_id = ?", (job_id,))}

    def record_decision(self, job_id: str, action: str, target: str, cause: str) -> None:
        with self.transaction() as db:
            db.execute(
                "INSERT INTO decisions (job_id, action, target, cause, at) VALUES (?,?,?,?,?)",
                (job_id, action, target, cause, time.time()),
            )

    def transitions(self, job_id: str) -> list[LogRecord]:
        rows = self._query(
            "SELECT entity, old, new, cause, at FROM transitions WHERE job_id = ? ORDER BY id", (job_id,)
        )
        return [LogRecord(*row) for row in rows]

    def decisions(self, job_id: str) -> list[LogRecord]:
        rows = self._query(
            "SELECT target, action, '', cause, at FROM decisions WHERE job_id = ? ORDER BY id", (job_id,)
        )
        return [LogRecord(*row) for row in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()


class JobStore:
    """The read side of one job's state, for everything beside its master: nodes, drivers, the
    views and the CLI. Every module that reads `job.sqlite` reads it through here; the master
    alone writes (through `SqliteStateStore`).

        with JobStore.open_readonly(output_dir, job_id) as job:
            spec = job.spec()
            nodes = job.wait_nodes("trainer", lambda n: n.state == NodeState.RUNNING, timeout_s=10.0)
    """

    def __init__(self, store: SqliteStateStore, job_id: str) -> None:
        self._store, self.job_id = store, job_id

    @classmethod
    def open_readonly(cls, output_dir: str | Path, job_id: str) -> JobStore:
        """The job `job_id` in `output_dir`; `ConfigError` when `output_dir` holds no job store."""
        return cls(SqliteStateStore.in_dir(output_dir, create=False), job_id)

    @classmethod
    def latest(cls, output_dir: str | Path) -> JobStore | None:
        """The newest job in `output_dir`, None when its store holds none yet (`ConfigError`: no store)."""
        store = SqliteStateStore.in_dir(output_dir, create=False)
        try:
            job_id = store.latest_job_id()
        except BaseException:
            store.close()
            raise
        if job_id is None:
            store.close()
            return None
        return cls(store, job_id)

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._store.close()

    def job(self) -> JobRecord:
        return self._store.job(self.job_id)

    def spec(self) -> dict[str, Any]:
        """The job's spec as the master stored it (JSON of `JobSpec`)."""
        return dict(json.loads(self.job().spec_json))

    def nodes(self, role: str | None = None) -> list[NodeRecord]:
        """The job's nodes (of `role`), in role and rank order."""
        return [n for n in self._store.nodes(self.job_id) if role is None or n.role == role]

    def node(self, node_id: str) -> NodeRecord | None:
        return next((n for n in self._store.nodes(self.job_id) if n.node_id == node_id), None)

    def decisions(self) -> list[LogRecord]:
        return self._store.decisions(self.job_id)

    def transitions(self) -> list[LogRecord]:
        return self._store.transitions(self.job_id)

    def wait_nodes(
        self,
        role: str,
        ready: Callable[[NodeRecord], bool],
        timeout_s: float,
        poll_s: float = 0.05,
        stop: Callable[[], bool] | None = None,
        live_only: bool = True,
        rank: int | None = None,
    ) -> list[NodeRecord]:
        """Poll until every node of `role` is `ready` (and there is one; `live_only`: its nodes not
        STOPPED, as a role scaled down keeps its stopped rows; `rank`: that node alone); those
        nodes in rank order.
        `WaitTimeoutError` after `timeout_s` naming each node's state; an empty list when `stop()`
        says to give up. The store has no change notification: polling is the only way to see
        another process's writes."""
        from rlplex.errors import WaitTimeoutError

        deadline = time.monotonic() + timeout_s
        while True:
            nodes = [
                n for n in self.nodes(role)
                if (not live_only or n.state != NodeState.STOPPED) and (rank is None or n.rank == rank)
            ]  # fmt: skip
            if nodes and all(ready(n) for n in nodes):
                return sorted(nodes, key=lambda n: n.rank)
            if stop is not None and stop():
                return []
            if time.monotonic() > deadline:
                shown = {n.node_id: n.state for n in nodes}
                raise WaitTimeoutError(f"role '{role}': not every node ready within {timeout_s:g} s: {shown}")
            time.sleep(poll_s)
