"""One orchestrator per run, as a node of the main job: rank r serves entry r of `runs.json`.

The run's orchestrator (`rlplex.multirun.orchestrator`) runs inside the node's process, so a
node killed with SIGKILL takes its orchestrator with it, and the control plane's restart
resumes the run from its first step whose rollouts are not stable. A run with
`rollout_workers = N > 1` generates on N nodes of the job's `rollout` role (`rollout_node`). Two ends of a run are not
faults for the control plane to heal, and end the node normally:
- eviction (by the trainer, by `rlplex runs evict`, or by the run itself);
- rejection: a user error of this run (the trainer refused its config, or the config cannot
  be used: exit code 2 of a standalone orchestrator). Restarting would fail the same way until
  the role's restart budget, which counts crashes, was spent and the whole job failed. The run
  is marked rejected with its reason (`rejected/<run id>.txt` in the job folder, beside the
  trainer's `control/config_validation_error.txt`), and the other runs go on.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from functools import partial

from pydantic import Field

from rlplex.config import StrictModel
from rlplex.control.node.worker import WorkerContext, WorkerLoad
from rlplex.errors import ConfigError
from rlplex.inference.vllm_server import usable_cores
from rlplex.mainjob.build import ORCHESTRATOR_ROLE
from rlplex.mainjob.registry import rejection_reason, run_for_rank, write_rejection
from rlplex.multirun.orchestrator.phase import Phase
from rlplex.multirun.rundir import RunDir, write_eviction
from rlplex.multirun.trainer.job import TRAINER_ROLE

log = logging.getLogger(__name__)


class OrchestratorNodeConfig(StrictModel):
    """`[roles.orchestrator.config]`: each rank's run is entry `rank` of the job's `runs.json`."""

    runs_dir: str = Field("runs", description="the run directories' folder, in the job's output folder")


def generation_threads(world: Mapping[str, int], cores: int) -> int:
    """Torch threads of an orchestrator that generates in its own process and whose run sets none:
    the cores the trainer's ranks (one thread each: `build.trainer_config`) leave, shared by the
    job's orchestrators. Torch's default, every core in every process, oversubscribes the machine
    as soon as a job has a trainer and one run."""
    left = max(1, cores - world.get(TRAINER_ROLE, 1))
    return max(1, left // max(1, world.get(ORCHESTRATOR_ROLE, 1)))


class OrchestratorNode(WorkerLoad):
    config_model = OrchestratorNodeConfig

    def __init__(self, context: WorkerContext) -> None:
        super().__init__(context)
        config = OrchestratorNodeConfig.model_validate(context.config)
        self.runs_dir = context.output_dir / config.runs_dir
        self.entry = run_for_rank(context.output_dir, context.rank)

    def self_check(self) -> None:
        self.entry.orch_config(str(self.context.output_dir / "runs.json"))  # a bad config fails prepare

    def run(self) -> None:
        from rlplex.mainjob.rollout_node import rollout_workers
        from rlplex.multirun.orchestrator.loop import RunEvictedError, run_orchestrator

        run = RunDir(self.runs_dir, self.entry.id)
        if rejection_reason(self.context.output_dir, self.entry.id) is not None or run.is_finished():
            return  # a job continued after a stop: this run's end is already final
        self.context.report_progress(run_index=self.context.rank)
        self._report_phase(Phase.PREPARING, 0)  # its imports and the model's load come first
        try:
            # The run's config, rebuilt from the registry's JSON; the orchestrator records it in
            # the run's `control/orch.toml` (the run-folder protocol the trainer reads).
            config = self.entry.orch_config(str(self.context.output_dir / "runs.json"))
            import torch

            if config.threads is None and config.rollout_workers == 1 and config.inference.engine == "hf":
                # Not written into the run's config: that is frozen once admitted, and a resume
                # on another machine would count other cores.
                torch.set_num_threads(generation_threads(self.context.world, usable_cores()))
            threads = torch.get_num_threads()
            print(f"[orchestrator] {self.entry.id}: {threads} torch threads", file=sys.stderr, flush=True)
            self.runs_dir.mkdir(exist_ok=True)
            workers = partial(rollout_workers, self.context, self.entry.id)
            run_orchestrator(
                self.runs_dir,
                self.entry.id,
                config,
                actor_workers=workers,
                tracker_dir=self.context.output_dir,
                report=self._report_phase,
            )
        except RunEvictedError:
            log.warning("run %s evicted: %s", self.entry.id, run.eviction_reason() or run.unwritten_eviction())
        except ConfigError as error:
            self._reject(run, str(error))
        except RuntimeError:
            if not run.is_evicted():
                raise
            log.warning("run %s evicted: %s", self.entry.id, run.eviction_reason())

    def _report_phase(self, phase: Phase, step: int) -> None:
        # The heartbeat's counters carry it to the master's store, where the view reads it.
        self.context.report_progress(phase=float(phase), phase_step=float(step))

    def _reject(self, run: RunDir, reason: str) -> None:
        log.warning("run %s rejected (final, not restarted): %s", self.entry.id, reason)
        write_rejection(self.context.output_dir, self.entry.id, reason)
        if run.exists() and not run.is_evicted() and not run.config_error.exists():
            # The trainer may hold a slot for it: eviction is how a slot is given back.
            write_eviction(run, f"rejected: {reason}")
