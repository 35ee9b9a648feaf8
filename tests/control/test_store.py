from __future__ import annotations

from pathlib import Path

import pytest

from rlplex.control import SqliteStateStore
from rlplex.control.job.store import JOURNAL_ENV, NodeRecord, journal_mode_for, mount_fstype
from rlplex.errors import ConfigError


def test_transaction_rolls_back_on_error(tmp_path: Path) -> None:
    store = SqliteStateStore(tmp_path / "job.sqlite")
    store.create_job("j1", "demo", '{"a": 1}')
    with pytest.raises(RuntimeError), store.transaction() as db:
        db.execute("UPDATE jobs SET state = 'RUNNING' WHERE job_id = 'j1'")
        raise RuntimeError("boom")
    assert store.job("j1").state == "INIT"


def test_state_survives_reopening_from_another_connection(tmp_path: Path) -> None:
    store = SqliteStateStore.in_dir(tmp_path)
    store.create_job("j1", "demo", '{"a": 1}')
    store.set_master("j1", "127.0.0.1:1234", 42)
    store.add_node("j1", "w-0", "w", 0, "PENDING")
    store.update_node("j1", "w-0", pid=99, address="127.0.0.1:5", restarts=2, incarnation=2)
    store.update_heartbeats("j1", [("w-0", 123.5, {"items": 7})])
    store.record_transition("j1", "w-0", "PENDING", "CREATED", "launched")
    assert store.spend_restart("j1", "w") == (1, 1)
    assert store.spend_restart("j1", "w") == (2, 2)
    store.record_decision("j1", "RESTART_WORKER", "w-0", "exited (code -9)")
    store.close()

    again = SqliteStateStore.in_dir(tmp_path, create=False)
    assert again.latest_job_id() == "j1"
    job = again.job("j1")
    assert (job.master_address, job.master_pid, job.restarts, job.spec_json) == ("127.0.0.1:1234", 42, 2, '{"a": 1}')
    (node,) = again.nodes("j1")
    assert (node.state, node.pid, node.address, node.restarts, node.incarnation) == ("CREATED", 99, "127.0.0.1:5", 2, 2)
    assert (node.last_heartbeat, node.progress, node.cause) == (123.5, {"items": 7}, "launched")
    assert again.role_restarts("j1") == {"w": 2}
    (decision,) = again.decisions("j1")
    assert (decision.entity, decision.old, decision.cause) == ("w-0", "RESTART_WORKER", "exited (code -9)")


def test_missing_store_and_unknown_fields_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no job state here"):
        SqliteStateStore.in_dir(tmp_path / "nothing", create=False)
    store = SqliteStateStore.in_dir(tmp_path)
    with pytest.raises(ConfigError, match="no job with id 'nope'"):
        store.job("nope")
    store.create_job("j1", "demo", "{}")
    store.add_node("j1", "w-0", "w", 0, "PENDING")
    with pytest.raises(ValueError, match="unknown node fields"):
        store.update_node("j1", "w-0", state="RUNNING")  # states change only through a transition


MOUNTS = """\
overlay / overlay rw,relatime 0 0
proc /proc proc rw,nosuid 0 0
/dev/sda1 /data ext4 rw,relatime 0 0
server:/export /data/shared nfs4 rw,vers=4.2,addr=10.0.0.2 0 0
user@host:/home /data/shared/my\\040sshfs fuse.sshfs rw,nosuid 0 0
//nas/rl /mnt/nas cifs rw,vers=3.0 0 0
tmpfs /mnt/nas tmpfs rw 0 0
"""


@pytest.mark.parametrize(
    ("path", "fstype", "mode"),
    [
        ("/data/run1", "ext4", "wal"),
        ("/data/shared", "nfs4", "delete"),
        ("/data/shared/run1/jobs", "nfs4", "delete"),
        ("/data/sharedx/run1", "ext4", "wal"),  # a prefix of the name, not of the path
        ("/data/shared/my sshfs/run", "fuse.sshfs", "delete"),
        ("/mnt/nas/run", "tmpfs", "wal"),  # mounted over the cifs share: the later line wins
        ("/home/me/run", "overlay", "wal"),
    ],
)
def test_journal_mode_follows_the_filesystem_of_the_job_folder(path: str, fstype: str, mode: str) -> None:
    assert mount_fstype(path, MOUNTS) == fstype
    assert journal_mode_for(path, MOUNTS, override="") == mode


def test_the_store_opens_in_the_chosen_journal_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for chosen, synchronous in (("delete", 2), ("wal", 1)):  # FULL with a rollback journal, NORMAL with WAL
        monkeypatch.setenv(JOURNAL_ENV, chosen.upper())
        store = SqliteStateStore.in_dir(tmp_path / chosen)
        store.create_job("j1", "demo", "{}")
        assert store._query("PRAGMA journal_mode") == [(chosen,)]
        assert store._query("PRAGMA synchronous") == [(synchronous,)]
        assert (tmp_path / chosen / "job.sqlite-wal").exists() == (chosen == "wal")
        store.close()
    monkeypatch.setenv(JOURNAL_ENV, "memory")
    with pytest.raises(ConfigError, match="RLPLEX_SQLITE_JOURNAL: 'memory' is not a journal mode"):
        SqliteStateStore.in_dir(tmp_path / "bad")


def running(node: NodeRecord) -> bool:
    return node.state == "RUNNING"


def test_job_store_is_the_read_side_and_waits_on_a_roles_nodes(tmp_path: Path) -> None:
    from rlplex.control import JobStore
    from rlplex.errors import WaitTimeoutError

    with pytest.raises(ConfigError, match="no job state here"):
        JobStore.latest(tmp_path)
    writer = SqliteStateStore.in_dir(tmp_path)
    assert JobStore.latest(tmp_path) is None
    writer.create_job("j1", "demo", '{"roles": {}}')
    for rank, state in enumerate(["RUNNING", "CREATED", "STOPPED"]):
        writer.add_node("j1", f"w-{rank}", "w", rank, state)
    writer.add_node("j1", "d-0", "d", 0, "RUNNING")
    latest = JobStore.latest(tmp_path)
    assert latest is not None and latest.job_id == "j1"
    latest.close()
    with JobStore.open_readonly(tmp_path, "j1") as job:
        assert job.spec() == {"roles": {}} and [n.node_id for n in job.nodes("w")] == ["w-0", "w-1", "w-2"]
        assert [n.node_id for n in job.wait_nodes("d", running, timeout_s=1.0)] == ["d-0"]
        assert [n.node_id for n in job.wait_nodes("w", running, timeout_s=1.0, rank=0)] == ["w-0"]
        with pytest.raises(WaitTimeoutError, match=r"role 'w'.*'w-1': 'CREATED'"):  # STOPPED rows are not waited on
            job.wait_nodes("w", running, timeout_s=0.1)
        assert job.wait_nodes("w", running, timeout_s=60.0, stop=lambda: True) == []

        def start_w1() -> bool:  # another process's write, seen by the next poll
            writer.record_transition("j1", "w-1", "CREATED", "RUNNING", "started")
            return False

        assert [n.node_id for n in job.wait_nodes("w", running, timeout_s=10.0, stop=start_w1)] == ["w-0", "w-1"]
        assert len(job.wait_nodes("w", lambda n: n.state != "CREATED", timeout_s=1.0, live_only=False)) == 3
    writer.close()
