from __future__ import annotations

from pathlib import Path

import pytest

from rlplex.control import JobBuilder, JobState, Placement, PrimeMaster, SqliteStateStore
from rlplex.errors import PlacementError


def test_one_bundle_per_node_and_colocated_roles_share(tmp_path: Path) -> None:
    spec = (
        JobBuilder("p", tmp_path, capacity={"cpu": 8, "gpu": 2, "memory_mb": 4096, "custom": {"sim": 1}})
        .role("actor", entrypoint="control_workers:Idle", count=2, colocate="g",
              resources={"cpu": 1, "gpu": 0.5, "memory_mb": 1000})
        .role("rollout", entrypoint="control_workers:Idle", count=2, colocate="g", resources={"cpu": 2})
        .role("env", entrypoint="control_workers:Idle", count=1, resources={"cpu": 1, "custom": {"sim": 1}})
        .role("trainer", kind="driver", entrypoint="control_workers:drive", resources={"cpu": 0})
        .build()
    )  # fmt: skip
    bundles = Placement.allocate(spec)
    by_members = {tuple(m.node_id for m in b.members): b for b in bundles}
    assert set(by_members) == {("actor-0", "rollout-0"), ("actor-1", "rollout-1"), ("env-0",), ("trainer-0",)}
    shared = by_members[("actor-1", "rollout-1")]
    assert (shared.cpu, shared.gpu, shared.memory_mb) == (3.0, 0.5, 1000)
    assert by_members[("env-0",)].custom == (("sim", 1.0),)
    assert [b.index for b in bundles] == list(range(4))


@pytest.mark.parametrize(
    ("resources", "needle"),
    [
        ({"cpu": 3}, "role 'big' rank 1: needs cpu=3 but only 1 of 4 is left"),
        ({"cpu": 0, "gpu": 1}, "role 'big' rank 0: needs gpu=1 but only 0 of 0 is left"),
        ({"cpu": 0, "custom": {"tpu": 1}}, "needs tpu=1"),
    ],
)
def test_a_job_that_does_not_fit_is_refused_naming_the_role(
    tmp_path: Path, resources: dict[str, object], needle: str
) -> None:
    spec = (
        JobBuilder("p", tmp_path, capacity={"cpu": 4})
        .role("big", entrypoint="control_workers:Idle", count=2, resources=resources)
        .build()
    )
    with pytest.raises(PlacementError, match=needle.replace("(", r"\(")):
        Placement.allocate(spec)


def test_unplaceable_job_is_refused_before_anything_starts(job_dir: Path) -> None:
    spec = (
        JobBuilder("p", job_dir, capacity={"cpu": 1})
        .role("w", entrypoint="control_workers:Idle", count=3, resources={"cpu": 0.5})
        .build()
    )
    master = PrimeMaster.create(spec)
    with pytest.raises(PlacementError, match="role 'w' rank 2"):
        master.start()
    assert master.state == JobState.FAILED
    store = SqliteStateStore.in_dir(job_dir, create=False)
    job_id = store.latest_job_id()
    assert job_id is not None
    assert store.nodes(job_id) == []
    assert "placement refused" in store.job(job_id).cause
    assert list((job_dir / "logs").iterdir()) == []  # no node was ever launched
    master.close()
