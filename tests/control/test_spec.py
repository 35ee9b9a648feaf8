from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlplex.control import JobBuilder, load_job
from rlplex.errors import JobSpecError


def build(tmp_path: Path, **role: object) -> object:
    fields = {"entrypoint": "control_workers:Counter", **role}
    return JobBuilder("t", tmp_path).role("r", **fields).build()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("role", "needle"),
    [
        ({"kind": "boss"}, "roles.r.kind"),
        ({"count": -1}, "roles.r.count"),
        ({"entrypoint": "no_such_module_x:Thing"}, "role 'r': field 'entrypoint': cannot import module"),
        ({"entrypoint": "control_workers:Missing"}, "role 'r': field 'entrypoint': module 'control_workers' has no"),
        ({"entrypoint": "control_workers:NOT_A_WORKER"}, "neither a Worker subclass nor a function"),
        ({"entrypoint": "not a path"}, "roles.r.entrypoint"),
        ({"kind": "submaster"}, "must subclass rlplex.control.SubMaster"),
        ({"kind": "submaster", "entrypoint": "control_workers:quick"}, "needs a SubMaster subclass"),
        ({"resources": {"cpu": -1}}, "roles.r.resources.cpu"),
        ({"restart": {"scope": "sometimes"}}, "roles.r.restart.scope"),
        ({"heartbeat_timeout_s": 0}, "roles.r.heartbeat_timeout_s"),
        ({"colour": "red"}, "roles.r.colour"),
        # Each role's config against its worker's config model, at load time (before any process).
        (
            {"kind": "submaster", "entrypoint": "rlplex.control.elastic:ElasticMaster",
             "config": {"workers": "r", "min_nodez": 1}},
            "role 'r': field 'config.min_nodez': Extra inputs are not permitted",
        ),
        (
            {"entrypoint": "rlplex.control.elastic:ElasticWorker",
             "config": {"entrypoint": "control_workers:wait_for_stop", "config": {"out": "x", "secondz": 1}}},
            "field 'config.config.secondz'",
        ),
        (
            {"entrypoint": "rlplex.control.elastic:ElasticWorker", "config": {"entrypoint": "control_workers:quick"}},
            "role 'r': 'control_workers:quick' must take one parameter annotated with its pydantic config model",
        ),
    ],
)  # fmt: skip
def test_bad_roles_are_refused_naming_role_and_field(tmp_path: Path, role: dict[str, object], needle: str) -> None:
    with pytest.raises(JobSpecError, match=None) as info:
        build(tmp_path, **role)
    assert needle in str(info.value)


def test_a_preload_that_names_no_module_is_refused_naming_field_and_value(tmp_path: Path) -> None:
    builder = JobBuilder("t", tmp_path, preload=["json", "no_such_module_x.sub"])
    with pytest.raises(JobSpecError, match=re.escape("field 'preload': no module named 'no_such_module_x.sub'")):
        builder.role("a", entrypoint="control_workers:Idle").build()


def test_colocation_groups_are_checked(tmp_path: Path) -> None:
    builder = JobBuilder("t", tmp_path).role("a", entrypoint="control_workers:Idle", count=2, colocate="g")
    with pytest.raises(JobSpecError, match="role 'b': field 'colocate': roles of group 'g' need equal counts"):
        builder.role("b", entrypoint="control_workers:Idle", count=3, colocate="g").build()
    builder = JobBuilder("t", tmp_path).role("a", entrypoint="control_workers:Idle", colocate="g")
    with pytest.raises(JobSpecError, match="drivers and sub-masters cannot share"):
        builder.role("d", kind="driver", entrypoint="control_workers:drive", colocate="g").build()


def test_role_declared_twice(tmp_path: Path) -> None:
    builder = JobBuilder("t", tmp_path).role("a", entrypoint="control_workers:Idle")
    with pytest.raises(JobSpecError, match="role 'a' declared twice"):
        builder.role("a", entrypoint="control_workers:Idle")


def test_load_job_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(
        'name = "demo"\noutput_dir = "out"\nmax_restarts = 2\n'
        '[roles.counter]\nkind = "worker"\ncount = 3\nentrypoint = "control_workers:Counter"\n'
        'resources = { cpu = 0.5, custom = { widget = 1 } }\nrestart = { scope = "role", max_restarts = 1 }\n'
        "progress_timeout_s = 4.0\nconfig = { items = 7 }\n"
        '[roles.driver]\nkind = "driver"\nentrypoint = "control_workers:drive"\n'
    )
    spec = load_job(path)
    counter = spec.roles["counter"]
    assert (counter.count, counter.resources.cpu, counter.resources.custom) == (3, 0.5, {"widget": 1.0})
    assert (counter.restart.scope, counter.restart.max_restarts, counter.progress_timeout_s) == ("role", 1, 4.0)
    assert counter.config == {"items": 7}
    assert spec.role_order() == ["counter", "driver"]
    assert spec.max_restarts == 2


def test_load_job_reports_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('name = "demo"\noutput_dir = "out"\n[roles.w]\ncount = "many"\nentrypoint = "m:f"\n')
    with pytest.raises(JobSpecError) as info:
        load_job(path)
    assert str(path) in str(info.value) and "roles.w.count" in str(info.value)


def test_backend_precedence_file_then_environment_then_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from rlplex.control.job.master import backend_overrides

    job = tmp_path / "job.toml"
    job.write_text(f'name = "p"\noutput_dir = "{tmp_path}"\nbackend = "ray"\nray_address = "file:1"\n'
                   '[roles.r]\nentrypoint = "control_workers:Counter"\n')  # fmt: skip
    spec = load_job(job)
    monkeypatch.delenv("RLPLEX_BACKEND", raising=False)
    monkeypatch.delenv("RLPLEX_RAY_ADDRESS", raising=False)
    assert (spec.backend, spec.ray_address, backend_overrides()) == ("ray", "file:1", {})
    monkeypatch.setenv("RLPLEX_BACKEND", "local")
    monkeypatch.setenv("RLPLEX_RAY_ADDRESS", "env:2")
    assert backend_overrides() == {"backend": "local", "ray_address": "env:2"}
    assert backend_overrides("ray", "flag:3") == {"backend": "ray", "ray_address": "flag:3"}
    with pytest.raises(JobSpecError, match="backend"):
        JobBuilder("p", tmp_path, backend="slurm").role("r", entrypoint="control_workers:Counter").build()


@pytest.mark.parametrize("bad", ["../../evil", "..", "a/b", ".hidden", "a..b", "", "x" * 300, "role\x00"])
def test_role_and_job_names_that_could_leave_the_output_folder_are_refused(tmp_path: Path, bad: str) -> None:
    """Names become log files and status files under the output folder: checked like run ids."""
    with pytest.raises(JobSpecError) as info:
        JobBuilder("t", tmp_path).role(bad, entrypoint="control_workers:Idle").build()
    assert f"field 'roles': {bad!r} is not a valid role name" in str(info.value)
    if bad:  # an empty job name is refused by pydantic's min_length first
        with pytest.raises(JobSpecError) as info:
            JobBuilder(bad, tmp_path).role("r", entrypoint="control_workers:Idle").build()
        assert f"field 'name': {bad!r} is not a valid job name" in str(info.value)


def test_ordinary_names_are_accepted(tmp_path: Path) -> None:
    spec = JobBuilder("job-1.v2", tmp_path).role("trainer_0", entrypoint="control_workers:Idle").build()
    assert list(spec.roles) == ["trainer_0"]
