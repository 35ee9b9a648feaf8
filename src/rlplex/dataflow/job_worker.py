"""Model workers placed and supervised by the control plane.

A role of a `rlplex.control` job whose entry point is `ModelWorkerNode` hosts one model
worker per node: the interface named in the role's config, its tensor store, and the
listener of `ModelServer` (calls from the master, fetches from peers). The dataflow master
(a driver role of the same job) reaches node `rank` of the role through a `JobModelWorker`,
which the `FunctionExecutor` uses exactly like a `ProcessModelWorker`:

    [roles.actor]                                    # in the job's TOML
    entrypoint = "rlplex.dataflow.job_worker:ModelWorkerNode"
    count = 2
    restart = { scope = "worker", max_restarts = 3 }
    config = { interface = "my_pkg.interfaces:Actor", kwargs = { lr = 1e-4 } }

    workers = {"actor": [JobModelWorker(context, "actor", r).start() for r in range(2)]}

Restarts are the control plane's: when a node dies mid-call, its handle waits for the
master to start the node's next incarnation (the role's restart policy and budgets decide
whether it does), connects to it and issues the call again. A node that died between calls
is found when another call needs the values it held (`revive`): the handle moves to the next
incarnation, and the executor recomputes what was lost. A call's outputs are recorded
only when it returns, so no datapoint is lost or run twice. The node's listener uses the
job's token as HMAC key, so the master and every peer node authenticate one another.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

from pydantic import Field

from rlplex.config import StrictModel
from rlplex.control.job.states import JobState, NodeState
from rlplex.control.job.store import JobStore, NodeRecord
from rlplex.control.node.worker import Worker, WorkerContext
from rlplex.control.rpc import RpcClient, parse_address
from rlplex.dataflow.process_worker import CALL_TIMEOUT_S, ModelServer, RemoteModelWorker
from rlplex.errors import ConfigError, WaitTimeoutError, WorkerDiedError

_POLL_S = 0.05


def load_interface(target: str, kwargs: dict[str, Any]) -> object:
    """Build the interface named 'module:attr' with `kwargs`; errors name the target."""
    module_name, _, attr = target.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(f"model worker interface {target!r} cannot be imported: {error}") from None
    return factory(**kwargs)


class ModelWorkerConfig(StrictModel):
    """`[roles.<model workers>.config]`."""

    interface: str = Field(pattern=r"^[\w.]+:[\w.]+$", description="'module:attr' of the model worker's interface")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="the interface's keyword arguments")


class ModelWorkerNode(Worker):
    """A control-plane worker serving one model worker until the job stops it.

    A subclass may build its interface another way (`build_interface`) under a config of its own."""

    config_model: ClassVar[type[StrictModel]] = ModelWorkerConfig

    def __init__(self, context: WorkerContext) -> None:
        super().__init__(context)
        self.server: ModelServer | None = None

    def build_interface(self) -> object:
        config = ModelWorkerConfig.model_validate(self.context.config)
        return load_interface(config.interface, config.kwargs)

    def self_check(self) -> None:
        # Built here, before start, so that a broken interface fails `prepare()` with its reason.
        import torch

        torch.set_num_threads(1)
        if self.server is None:
            self.server = ModelServer(self.context.node_id, self.build_interface(), self.context.token, self._called)

    def _called(self) -> None:
        assert self.server is not None
        self.context.report_progress(calls=self.server.calls)

    def start(self) -> None:
        self.self_check()  # the listener serves from here on: a master that reconnects is served again
        super().start()

    def address(self) -> list[Any]:
        """Where the master sends calls and peers fetch tensors."""
        if self.server is None:
            raise WorkerDiedError(f"{self.context.node_id}: model server not built (self_check not run)")
        return list(self.server.address)

    def stop(self) -> None:
        super().stop()
        if self.server is not None:
            self.server.close()


class JobModelWorker(RemoteModelWorker):
    """The master's handle on node `rank` of a `ModelWorkerNode` role (see the module docstring)."""

    def __init__(
        self, context: WorkerContext, role: str, rank: int, restart_timeout_s: float = 60.0,
        call_timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:  # fmt: skip
        super().__init__(f"{role}-{rank}", authkey=context.token, call_timeout_s=call_timeout_s)
        self.context, self.role, self.rank = context, role, rank
        self.restart_timeout_s = restart_timeout_s
        self.incarnation = -1

    def _node(self, job: JobStore) -> NodeRecord | None:
        return next((n for n in job.nodes(self.role) if n.rank == self.rank), None)

    def _wait_running(self, after_incarnation: int, timeout_s: float) -> NodeRecord:
        """Node `rank` of the role RUNNING in an incarnation after `after_incarnation`."""
        with JobStore.open_readonly(self.context.output_dir, self.context.job_id) as job:

            def running(node: NodeRecord) -> bool:
                return node.state == NodeState.RUNNING and bool(node.address) and node.incarnation > after_incarnation

            def gone() -> bool:
                """A node that failed or stopped for good: the job is ending, so no restart will come."""
                last = self._node(job)
                return (
                    last is not None and after_incarnation >= 0 and last.state in (NodeState.FAILED, NodeState.STOPPED)
                    and last.incarnation <= after_incarnation
                    and job.job().state in (JobState.STOPPING, JobState.STOPPED, JobState.FAILED)
                )  # fmt: skip

            try:
                nodes = job.wait_nodes(self.role, running, timeout_s, _POLL_S, gone, live_only=False, rank=self.rank)
            except WaitTimeoutError:
                last = self._node(job)
                seen = f"{last.state} (incarnation {last.incarnation})" if last else "absent"
                raise WorkerDiedError(
                    f"model worker {self.name!r} not RUNNING again within {timeout_s:g} s; node is {seen}"
                ) from None
            if not nodes:
                last = self._node(job)
                state = last.state if last else "absent"
                raise WorkerDiedError(f"model worker {self.name!r} is {state} and will not come back")
            return nodes[0]

    def _died_between_calls(self) -> bool:
        """The node does not answer, or is no longer the incarnation this handle is connected to
        (the master may not have seen the death yet: the first test comes first)."""
        if super()._died_between_calls():
            return True
        with JobStore.open_readonly(self.context.output_dir, self.context.job_id) as job:
            node = self._node(job)
        return node is None or node.incarnation != self.incarnation or node.state != NodeState.RUNNING

    def _launch(self) -> tuple[str, int]:
        """The address of the node's next RUNNING incarnation (restarts are the job's to decide)."""
        record = self._wait_running(self.incarnation, self.restart_timeout_s)
        rpc = RpcClient(parse_address(record.address), self.context.token, record.node_id)
        try:
            host, port = rpc.call("call", "address")
        finally:
            rpc.close()
        self.incarnation = record.incarnation
        return (str(host), int(port))
