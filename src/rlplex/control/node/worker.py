"""What runs inside a node: the `Worker` hooks, `SubMaster`, `WorkerLoad` and the `WorkerContext`.

The master drives a node through its hooks, in the seed's order: `__init__(context)`,
`status()` (ping), `self_check()`, `check_child()` (sub-masters), `start()`, then `status()`
until it says FINISHED, and `stop()`. Hooks raise to report a failure; the message becomes
the recorded cause.

Extension points: subclass `Worker` (start must not block: run your loop in a thread),
`SubMaster` for a custom sub-master, or `WorkerLoad` and override `run()` (the loop runs in a
thread for you). A plain function `def run(context) -> None` is an entry point too: it is
wrapped in a `FunctionWorker`.

This module imports neither pydantic nor torch: it is loaded by every node process.
"""

from __future__ import annotations

import importlib
import inspect
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from rlplex.control.job.states import NodeState
from rlplex.errors import JobSpecError

if TYPE_CHECKING:
    from rlplex.control.node.role_group import RoleGroup


def job_channel_prefix(job_id: str) -> str:
    return f"{job_id}."


@dataclass
class WorkerContext:
    """What a worker knows of its job. `report_progress` feeds the heartbeats."""

    job_id: str
    role: str
    rank: int
    node_id: str
    world: dict[str, int]
    config: dict[str, Any]
    output_dir: Path
    incarnation: int = 0
    token: bytes = b""
    # The address the other nodes reach this one at: 127.0.0.1 on one machine, this machine's IP on a
    # multi-machine Ray cluster. Servers a worker opens for its peers (a rendezvous store) listen on it.
    host: str = "127.0.0.1"
    backend: str = "local"  # where the job runs its nodes ("local" or "ray"): what a job channel is made of
    stop_event: threading.Event = field(default_factory=threading.Event)
    _progress: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def report_progress(self, **counters: float) -> None:
        """Set progress counters (e.g. `items=12`). Unchanged counters past the role's progress deadline = hang."""
        with self._lock:
            self._progress.update(counters)

    def progress(self) -> dict[str, float]:
        with self._lock:
            return dict(self._progress)

    def should_stop(self) -> bool:
        return self.stop_event.is_set()

    def channel_name(self, name: str) -> str:
        """The name of a `LocalDataChannel` this job owns: the job's end (stopped or failed) unlinks it."""
        return f"{job_channel_prefix(self.job_id)}{name}"

    def role_group(self, role: str, timeout_s: float = 10.0) -> RoleGroup:
        """A handle to call methods on every node of `role` (the trainer-driven pattern)."""
        from rlplex.control.node.role_group import RoleGroup

        return RoleGroup.connect(self, role, timeout_s)


class Worker:
    """Base of every node. Override the hooks you need; `start()` must return promptly.

    `config_model`: the pydantic model of the role's `config` table. The job's check validates
    every role's config against it when the job file is loaded, before any process starts, so a
    wrong field fails there, naming the role and the field; None takes any table."""

    config_model: ClassVar[Any] = None

    @classmethod
    def validate_config(cls, config: dict[str, Any]) -> Any:
        """The role's config as its model (raises pydantic's ValidationError, or `JobSpecError`);
        the config itself when the class declares no model."""
        return config if cls.config_model is None else cls.config_model.model_validate(config)

    def __init__(self, context: WorkerContext) -> None:
        self.context = context
        self.error: str | None = None
        self._state = NodeState.CREATED

    def status(self) -> str:
        """CREATED, RUNNING, FINISHED or FAILED (then `self.error` says why)."""
        return self._state

    def self_check(self) -> None:
        """Raise if this node cannot do its work (missing files, no device, ...)."""

    def start(self) -> None:
        self._state = NodeState.RUNNING

    def stop(self) -> None:
        self.context.stop_event.set()


class SubMaster(Worker):
    """A node that manages children of its own (e.g. an `ElasticMaster`)."""

    def check_child(self) -> None:
        """Raise if a child is not ready; called after `self_check()`, before `start()`."""


class WorkerLoad(Worker):
    """A worker whose work is `run()`, called in a thread by `start()`; FINISHED when it returns."""

    def __init__(self, context: WorkerContext) -> None:
        super().__init__(context)
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        raise NotImplementedError(f"{type(self).__name__}.run()")

    def start(self) -> None:
        self._state = NodeState.RUNNING
        self._thread = threading.Thread(target=self._main, name=f"{self.context.node_id}-run", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            self.run()
        except BaseException as error:  # the node reports it; the traceback goes to the node's log
            traceback.print_exc()
            self.error = f"{type(error).__name__}: {error}"
            self._state = NodeState.FAILED
        else:
            self._state = NodeState.FINISHED


class FunctionWorker(WorkerLoad):
    """Wraps `def run(context) -> None` (drivers, self-loops) into a worker."""

    function: Callable[[WorkerContext], None]

    def run(self) -> None:
        type(self).function(self.context)


def import_target(target: str) -> Any:
    """Import 'module:attr' (attr may be dotted) and return the object; raise `JobSpecError` saying why not."""
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise JobSpecError(f"cannot import module '{module_name}' of '{target}': {error}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise JobSpecError(f"module '{module_name}' has no attribute '{attr}'")
        obj = getattr(obj, part)
    return obj


def load_entrypoint(target: str, kind: str) -> type[Worker]:
    """Import 'module:attr' and return a Worker class fit for `kind`; raise `JobSpecError` saying why not."""
    obj = import_target(target)
    attr = target.partition(":")[2]
    if inspect.isclass(obj):
        if kind == "submaster" and not issubclass(obj, SubMaster):
            raise JobSpecError(f"'{target}' must subclass rlplex.control.SubMaster for a submaster role")
        if not issubclass(obj, Worker):
            raise JobSpecError(f"'{target}' is a class but not a subclass of rlplex.control.Worker")
        return obj
    if callable(obj):
        if kind == "submaster":
            raise JobSpecError(f"'{target}' is a function; a submaster role needs a SubMaster subclass")
        # A function declares its role's config model as an attribute, as a class does.
        fields = {"function": staticmethod(obj), "config_model": getattr(obj, "config_model", None)}
        return type(f"FunctionWorker[{attr}]", (FunctionWorker,), fields)
    raise JobSpecError(f"'{target}' is neither a Worker subclass nor a function")
