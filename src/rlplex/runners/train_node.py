"""`rlplex train --supervise`: a classic run as the node of a local control-plane job.

The job has one role, `train`, whose node builds the runner from the run's `TrainConfig` (its
config crosses into the node once, as that model's JSON, and `load_job` validates it) and
trains it to `n_steps`. Whatever the runner starts (a parallel sampler's workers, `SyncRl`'s
ranks) is the node's children and dies with it, as with a plain `rlplex train`. What the job
adds is the control plane's healing: a node that crashes, is SIGKILLed or stops sending its
heartbeats is restarted by the job's `FailurePolicy` (up to `max_restarts`) and resumes from
the newest snapshot in the output folder, so a long run survives what would end an
unsupervised one; `rlplex job status <output>/train_job` shows it. A rerun of the same
command re-attaches to a job that a killed command left running.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TextIO

from pydantic import Field

from rlplex.config import StrictModel
from rlplex.control.job.local_run import run_local_job
from rlplex.control.job.spec import JobSpec, parse_job
from rlplex.control.node.worker import WorkerLoad
from rlplex.runners.config import TrainConfig

log = logging.getLogger(__name__)

TRAIN_ROLE = "train"
JOB_FOLDER = "train_job"  # the job's folder under the run's output folder


class TrainNodeConfig(StrictModel):
    """`[roles.train.config]`: the run and where its outputs (progress, snapshots) go."""

    train: TrainConfig
    output: str = Field(min_length=1, description="the run's output folder (absolute)")


class TrainNode(WorkerLoad):
    config_model = TrainNodeConfig

    def run(self) -> None:
        from rlplex.io.snapshot import list_snapshots
        from rlplex.runners.config import build_runner

        config = TrainNodeConfig.model_validate(self.context.config)
        output = Path(config.output)
        runner = build_runner(config.train, output)  # in a log, a plain progress line every 10 s
        # Each logged row is the node's progress (`rlplex job status`; a role's progress deadline
        # watches it). SyncRl's rows are written in its rank 0, a process of its own: none there.
        runner.on_log_row = lambda env_steps, _row: self.context.report_progress(env_steps=env_steps)
        snapshots = list_snapshots(output / "snapshots")
        if snapshots:  # a restart, or a run continued with --resume: on from the newest snapshot
            newest = snapshots[-1][1]
            log.info("resuming from %s", newest)
            runner.resume_from(newest)
        result = runner.train()
        log.info("trained %d env steps in %.1f s", result.env_steps, result.wall_time_s)


def train_job_spec(config: TrainConfig, output: Path, max_restarts: int = 3) -> JobSpec:
    """The supervised run's job, in `<output>/train_job`."""
    data = {
        "name": "train",
        "output_dir": str((output / JOB_FOLDER).resolve()),
        "backend": "local",
        "max_restarts": max_restarts + 1,  # the node's restarts, with room for a master take-over
        "capacity": {"cpu": 2.0},  # placement's books only: the node takes what the run needs
        "heartbeat_interval_s": 0.5,
        "start_timeout_s": 180.0,  # the node imports torch and the environment before it is ready
        "preload": ["torch", "gymnasium", "rlplex.runners.train_node"],  # once: a restarted node starts warm
        "roles": {
            TRAIN_ROLE: {
                "entrypoint": "rlplex.runners.train_node:TrainNode",
                "resources": {"cpu": 1.0},
                "restart": {"scope": "worker", "max_restarts": max_restarts},
                "config": {"train": config.model_dump(mode="json"), "output": str(output.resolve())},
            }
        },
    }
    return parse_job(data, source="rlplex train --supervise")


def run_train_job(config: TrainConfig, output: Path, max_restarts: int = 3, out: TextIO = sys.stdout) -> int:
    """Run `config` under its job until the job ends; the exit code of `run_local_job`."""
    return run_local_job(train_job_spec(config, output, max_restarts), f"{TRAIN_ROLE}-0.log", out)
