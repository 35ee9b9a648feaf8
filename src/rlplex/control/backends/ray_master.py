"""The master on Ray: a detached actor that Ray restarts (`max_restarts`) when it dies.

    handle = RayMasterHandle.launch(spec)      # the actor runs PrimeMaster.create / start / wait
    state = handle.wait(timeout=600)           # "STOPPED" or "FAILED" (cause in handle.info())
    handle.close()                             # give the actor back
    handle = RayMasterHandle.resume(output_dir)  # `rlplex job resume`: a new master actor for the job

A first start creates the job (or, launched by `resume`, resumes it); a restart (Ray
reconstructs the actor after its process died) takes the resume path,
`PrimeMaster.resume(output_dir)`: reload the SQLite state, re-attach to the node actors that
are alive (they are detached and outlive the master), restart lost ones.
The control loop runs in a thread of the actor, so `info()` and `wait()` answer while it runs.
The actor is named after the job's output folder, so one folder never has two live masters.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from rlplex.control.backends.ray import NAMESPACE, connect_ray, forwarded_env
from rlplex.control.job.spec import JobSpec, parse_job
from rlplex.control.job.states import TERMINAL_JOB_STATES, JobState
from rlplex.errors import ConfigError, JobFailedError, RlplexError, WaitTimeoutError

# A finished master keeps its result this long for a driver to read, then gives its actor back.
_LINGER_S = 300.0


class MasterActor:
    def __init__(self, spec_json: str, env: dict[str, str], resume: bool = False) -> None:
        os.environ.update(env)
        self._spec: JobSpec = parse_job(JobSpec.model_validate_json(spec_json).model_dump(mode="json"))
        # Launched to resume a job whose master is gone, or restarted by Ray after this one died.
        self.resumed = resume or bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self._master: Any = None
        self._done = threading.Event()
        self._stop = threading.Event()
        self._result: dict[str, Any] = {"state": JobState.INIT.value, "cause": "", "job_id": ""}
        threading.Thread(target=self._main, name="prime-master", daemon=True).start()

    def _main(self) -> None:
        from rlplex.control.job.master import PrimeMaster

        try:
            if self.resumed:
                ended = _ended_job(self._spec)
                if ended is not None:  # the previous incarnation died after the job's end
                    self._result.update(ended)
                    return
                self._master = PrimeMaster.resume(self._spec.output_dir)
            else:
                self._master = PrimeMaster.create(self._spec, backend="ray")
            master = self._master
            self._result["job_id"] = master.job_id
            master.start()
            interval = self._spec.monitor_interval_s
            while master.monitor() not in TERMINAL_JOB_STATES:
                if self._stop.is_set():
                    master.stop("stopped by the driver")
                    break
                if master.stop_if_requested():
                    break
                time.sleep(interval)
            self._result.update(state=master.state.value, cause=master.store.job(master.job_id).cause)
        except RlplexError as error:
            self._result.update(state=JobState.FAILED.value, cause=str(error))
        except BaseException as error:
            self._result.update(state=JobState.FAILED.value, cause=f"master crashed: {error!r}")
        finally:
            if self._master is not None:
                try:
                    self._master.stop("master exiting")
                finally:
                    self._master.close()
            self._done.set()
        if not self._stop.wait(_LINGER_S):
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def info(self) -> dict[str, Any]:
        """The job's state as this master sees it, with its pid and whether it is a resumed master."""
        master = self._master
        out = {**self._result, "pid": os.getpid(), "resumed": self.resumed, "done": self._done.is_set()}
        if master is not None and not self._done.is_set():
            slots = list(master.manager.slots.values())
            out["state"] = master.state.value
            out["connected"] = sum(s.connected for s in slots)
            out["nodes"] = {s.node_id: s.state.value for s in slots}
            out["failover_pending"] = master.manager.failover_pending
        return out

    def wait(self, timeout_s: float) -> dict[str, Any] | None:
        return self.info() if self._done.wait(timeout_s) else None

    def stop(self) -> None:
        self._stop.set()


RemoteMaster: Any = ray.remote(MasterActor)


def _ended_job(spec: JobSpec) -> dict[str, Any] | None:
    from rlplex.control.job.store import JobStore

    store = JobStore.latest(spec.output_dir)
    if store is None:
        return None
    with store:
        job = store.job()
        ended = JobState(job.state) in TERMINAL_JOB_STATES
        return {"state": job.state, "cause": job.cause, "job_id": job.job_id} if ended else None


def master_actor_name(spec: JobSpec) -> str:
    """The master actor's name: one per output folder (`spec.output_dir` must be absolute)."""
    folder = hashlib.sha256(str(spec.output_dir).encode()).hexdigest()[:12]
    return f"rlplex-master-{spec.name}-{folder}"


def _free_name(name: str, spec: JobSpec) -> None:
    """Refuse to start a second master for a folder; give back a finished master that still holds the name."""
    deadline = time.monotonic() + 30.0
    while True:
        try:
            existing: Any = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        try:
            info: dict[str, Any] | None = ray.get(existing.info.remote(), timeout=10.0)
        except RayActorError:  # dying: its name is free once Ray has recorded the death (or it restarts)
            info = None
        except (GetTimeoutError, RayError):  # restarting, or busy: a master all the same
            info = {"done": False}
        if info is not None and not info.get("done"):
            raise ConfigError(
                f"{spec.output_dir}: job '{spec.name}' already has a live master (Ray actor '{name}'); "
                f"watch it with: rlplex job status {spec.output_dir}"
            )
        if info is not None:
            ray.kill(existing, no_restart=True)
        if time.monotonic() > deadline:
            raise ConfigError(f"{spec.output_dir}: the old master actor '{name}' did not go away within 30 s")
        time.sleep(0.05)


class RayMasterHandle:
    """The driver's side of a master actor."""

    def __init__(self, actor: Any, spec: JobSpec) -> None:
        self.actor, self.spec = actor, spec

    @classmethod
    def launch(cls, spec: JobSpec, max_restarts: int = 3, resume: bool = False) -> RayMasterHandle:
        """Start the master actor of a new job (`resume`: of the unfinished job in `spec.output_dir`)."""
        # The actor's working folder is Ray's: the output folder must be absolute before it travels.
        spec = spec.model_copy(update={"backend": "ray", "output_dir": spec.output_dir.resolve()})
        connect_ray(spec.ray_address, spec.capacity)
        name = master_actor_name(spec)
        _free_name(name, spec)
        actor = RemoteMaster.options(
            name=name, namespace=NAMESPACE, lifetime="detached", max_restarts=max_restarts, num_cpus=0,
            max_concurrency=8,
        ).remote(spec.model_dump_json(), forwarded_env(), resume)  # fmt: skip
        return cls(actor, spec)

    @classmethod
    def resume(cls, output_dir: str | Path, ray_address: str | None = None, max_restarts: int = 3) -> RayMasterHandle:
        """Master failover on Ray: a new master actor reloads the job in `output_dir` and goes on.

        `ray_address` (else the job's) is the cluster its node actors live on."""
        from rlplex.control.job.master import resumable_spec

        spec = resumable_spec(output_dir)
        if spec.backend != "ray":
            raise ConfigError(f"{spec.output_dir}: job '{spec.name}' runs on backend '{spec.backend}', not on Ray")
        if ray_address is not None:
            spec = spec.model_copy(update={"ray_address": ray_address})
        return cls.launch(spec, max_restarts, resume=True)

    def info(self, timeout_s: float = 30.0) -> dict[str, Any]:
        result: dict[str, Any] = ray.get(self.actor.info.remote(), timeout=timeout_s)
        return result

    def wait(self, timeout: float | None = None, raise_on_failure: bool = True) -> JobState:
        """Wait for the job's end across master restarts (a call lost with a dying master is asked again)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        failures = 0
        while True:
            left = 5.0 if deadline is None else min(5.0, deadline - time.monotonic())
            if left <= 0:
                raise WaitTimeoutError(f"job '{self.spec.name}' not finished after {timeout} s")
            try:
                info = ray.get(self.actor.wait.remote(left), timeout=left + 30.0)
                failures = 0
            except (GetTimeoutError, RayError) as error:
                # A call in flight when the master dies fails; calls made while Ray restarts it
                # wait for the next incarnation. Failing again and again means it is gone for good.
                failures += 1
                if failures > 5:
                    raise JobFailedError(
                        f"job '{self.spec.name}': the master actor is gone ({type(error).__name__}); "
                        f"resume with: rlplex job resume {self.spec.output_dir}"
                    ) from None
                info = None
                time.sleep(0.2)
            if info is not None:
                break
        state = JobState(info["state"])
        if state == JobState.FAILED and raise_on_failure:
            raise JobFailedError(f"job {info['job_id'] or self.spec.name} failed: {info['cause']}")
        return state

    def stop(self) -> None:
        try:
            ray.get(self.actor.stop.remote(), timeout=30.0)
        except RayError:
            pass

    def close(self) -> None:
        """Give the master actor back (after `wait()`; a running job is stopped first)."""
        try:
            done = bool(self.info().get("done"))
        except RayError:
            done = True
        if not done:
            self.stop()
            try:
                self.wait(timeout=60.0, raise_on_failure=False)
            except (RlplexError, RayError):
                pass
        try:
            ray.kill(self.actor, no_restart=True)
        except RayError:
            pass
