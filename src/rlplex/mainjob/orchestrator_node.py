"""One orchestrator per run, as a node of the main job: rank r serves entry r of `runs.json`.

The run's orchestrator (`rlplex.multirun.orchestrator`) runs inside the node's process, so a
node killed with SIGKILL takes its orchestrator with it, and the control plane's restart
resumes the run from its first step whose rollouts are not stable. A run evicted (by the
trainer, by `rlplex runs evict`, or by itself) ends its node normally: eviction is the
run's end, not a fault for the control plane to heal.
"""

from __future__ import annotations

import logging

from rlplex.control.worker import WorkerContext, WorkerLoad
from rlplex.mainjob.registry import run_for_rank
from rlplex.multirun.orch_config import orch_config_to_toml
from rlplex.multirun.rundir import RunDir, write_file_atomic

log = logging.getLogger(__name__)

EXIT_EVICTED = 3


class OrchestratorNode(WorkerLoad):
    def __init__(self, context: WorkerContext) -> None:
        super().__init__(context)
        self.runs_dir = context.output_dir / str(context.config.get("runs_dir", "runs"))
        self.entry = run_for_rank(context.output_dir, context.rank)

    def self_check(self) -> None:
        self.entry.orch_config(str(self.context.output_dir / "runs.json"))  # a bad config fails prepare

    def run(self) -> None:
        from rlplex.multirun.orchestrator import main as orchestrator_main

        config = self.entry.orch_config(str(self.context.output_dir / "runs.json"))
        config_dir = self.context.output_dir / "orch_configs"
        config_dir.mkdir(exist_ok=True)
        path = config_dir / f"{self.entry.id}.toml"
        write_file_atomic(path, orch_config_to_toml(config).encode())
        self.runs_dir.mkdir(exist_ok=True)
        self.context.report_progress(run_index=self.context.rank)
        try:
            code = orchestrator_main([str(self.runs_dir), self.entry.id, str(path)])
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except RuntimeError:
            if not RunDir(self.runs_dir, self.entry.id).is_evicted():
                raise
            code = EXIT_EVICTED
        if code == EXIT_EVICTED:
            log.warning("run %s evicted: %s", self.entry.id, RunDir(self.runs_dir, self.entry.id).eviction_reason())
            return
        if code:
            raise RuntimeError(f"orchestrator of {self.entry.id} exited with code {code}")
