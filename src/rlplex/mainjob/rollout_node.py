"""The main job's rollout role: the processes a run with `rollout_workers = N > 1` generates on.

Each node serves one model worker (`rlplex.dataflow.job_worker.ModelWorkerNode`) holding the
run's actor: the base model loaded with `from_pretrained` and the run's broadcast adapters read
from its run folder. Node `rank` generates for the run `registry.rollout_slots` names; the run's
orchestrator reaches its nodes through `JobModelWorker`s. They are nodes of the job like any
other, so the control plane places, watches and restarts them under the role's restart budget;
an orchestrator whose node died waits for the node's next incarnation and issues the call again.
"""

from __future__ import annotations

import logging

from rlplex.control.node.worker import WorkerContext
from rlplex.dataflow import JobModelWorker, ModelWorker
from rlplex.dataflow.job_worker import ModelWorkerNode
from rlplex.errors import ConfigError
from rlplex.mainjob.build import ROLLOUT_ROLE
from rlplex.mainjob.orchestrator_node import OrchestratorNodeConfig
from rlplex.mainjob.registry import read_registry, rollout_ranks, rollout_slots

log = logging.getLogger(__name__)

START_TIMEOUT_S = 180.0  # the nodes load the model before they report RUNNING: minutes on a busy laptop


class Unusable:
    """The interface of a node whose run cannot generate (its config was rejected): the node
    stays up, since failing it would spend the role's restart budget on a run that has ended,
    and the run's orchestrator, which rejects the run itself, never calls it."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def generate(self, *args: object) -> None:
        raise ConfigError(self.reason)


class RolloutNode(ModelWorkerNode):
    config_model = OrchestratorNodeConfig

    def __init__(self, context: WorkerContext) -> None:
        super().__init__(context)
        self.runs_dir = context.output_dir / OrchestratorNodeConfig.model_validate(context.config).runs_dir

    def build_interface(self) -> object:
        from rlplex.multirun.orchestrator.models import ActorModel

        entries = read_registry(self.context.output_dir)
        slots = rollout_slots(entries)
        if not 0 <= self.context.rank < len(slots):
            raise ConfigError(f"rollout rank {self.context.rank}: the run registry has {len(slots)} rollout slots")
        entry = next(e for e in entries if e.id == slots[self.context.rank])
        try:
            return ActorModel.for_run(self.runs_dir, entry.id, entry.orch_config("runs.json"))
        except ConfigError as error:
            log.warning("rollout node for run %s serves nothing: %s", entry.id, error)
            return Unusable(f"run {entry.id}: {error}")


def rollout_workers(context: WorkerContext, run_id: str) -> list[ModelWorker]:
    """The orchestrator's handles on its run's rollout nodes, each connected once it runs."""
    ranks = rollout_ranks(context.output_dir, run_id)
    workers: list[JobModelWorker] = []
    try:
        for rank in ranks:
            workers.append(JobModelWorker(context, ROLLOUT_ROLE, rank, restart_timeout_s=START_TIMEOUT_S).start())
    except BaseException:
        for worker in workers:
            worker.close()
        raise
    return list(workers)
