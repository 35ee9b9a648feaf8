"""The trainer as control-plane roles, and the standalone trainer as a job of its own.

`trainer_roles` declares the multi-run trainer the one way both of its users run it: the main
job (`rlplex.mainjob.build`) and `python -m rlplex.multirun.trainer` (`run_trainer_job`). Its
ranks are `ElasticWorker`s that run `run_trainer(TrainerConfig)`, the config crossing into each
rank once as the JSON of its model; an `ElasticMaster` forms their group, re-forms it after a
rank dies (the trainer resumes every run from its checkpoints) and spends the restart budget.

The graceful stop goes through the control plane: `ask_trainer_to_stop` calls each rank's
`ElasticWorker.request_stop`, whose script checkpoints every run ahead of its last checkpoint
and exits 0, so the ranks and the ElasticMaster finish and the job ends FINISHED.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from rlplex.control.job.local_run import run_local_job
from rlplex.control.job.spec import JobSpec, parse_job
from rlplex.control.job.token import read_token
from rlplex.errors import RlplexError, WaitTimeoutError
from rlplex.multirun.trainer.config import TrainerConfig

if TYPE_CHECKING:
    from rlplex.control.job.master import PrimeMaster

log = logging.getLogger(__name__)

TRAINER_ROLE = "trainer"
ELASTIC_ROLE = "elastic"
JOB_FOLDER = "trainer_job"  # the standalone job's folder under the trainer's output_dir (no run_ prefix)
STOP_GRACE_S = 15.0  # a stopped rank checkpoints every run ahead of its last checkpoint first
ASK_AGAIN_S = 20.0  # a rank restarted while the stop was asked is told by its environment; this is a backstop


def trainer_roles(config: TrainerConfig, world_size: int, max_restarts: int) -> dict[str, dict[str, Any]]:
    """The `trainer` role (one ElasticWorker per rank) and its `elastic` sub-master, as job-spec data."""
    return {
        TRAINER_ROLE: {
            "entrypoint": "rlplex.control.elastic:ElasticWorker",
            "count": world_size,
            "resources": {"cpu": 0.5},
            "restart": {"scope": "worker", "max_restarts": max_restarts},
            "heartbeat_timeout_s": 10.0,
            "config": {
                "entrypoint": "rlplex.multirun.trainer:run_trainer",
                "config": config.model_dump(mode="json"),
                "stop_grace_s": STOP_GRACE_S,
            },
        },
        ELASTIC_ROLE: {
            "kind": "submaster",
            "entrypoint": "rlplex.control.elastic:ElasticMaster",
            "resources": {"cpu": 0.05},
            "restart": {"scope": "worker", "max_restarts": max_restarts},
            # A trainer node that dies is seen at once; silence means a hang. 30 s, not the
            # default 10: its agent thread can starve while the node imports torch and loads the
            # model on a busy machine (a node check failed at prepare that way).
            "config": {
                "workers": TRAINER_ROLE,
                "min_nodes": world_size,
                "max_nodes": world_size,
                "join_timeout_s": 60.0,
                "member_timeout_s": 30.0,
                # The node check imports torch and forms a gloo group in a fresh process on every
                # rank, as slow as a node's start on a busy machine (start_timeout_s, job_timing);
                # the default 60 s failed a main job's prepare on Ray beside two busy loops.
                "check_timeout_s": 180.0,
                "max_restarts": max_restarts,
            },
        },
    }


def job_timing(world_size: int) -> dict[str, Any]:
    """The job-level settings a trainer needs on a small machine, shared by both of its jobs."""
    return {
        # Small shares: on a 2-core laptop the processes take turns; placement still refuses a
        # trainer wider than the machine.
        "capacity": {"cpu": max(2.0, 0.5 * world_size + 1.0)},
        "heartbeat_interval_s": 0.5,
        # Every node imports torch before it reports ready: minutes on a busy 2-core machine.
        "start_timeout_s": 180.0,
        "rpc_timeout_s": 120.0,
        # A stopped job waits this long for its nodes before it kills them: each rank's graceful
        # stop (checkpointing every run ahead of its last checkpoint) must fit, with room to spare.
        # The default 3 s killed a main job's ranks mid-checkpoint on SIGTERM (issue 32, hole 6).
        "stop_grace_s": STOP_GRACE_S + 5.0,
    }


def trainer_job_spec(config: TrainerConfig, world_size: int = 1, max_restarts: int = 3) -> JobSpec:
    """The standalone trainer's job: its ranks and their sub-master, in `<output_dir>/trainer_job`."""
    data = {
        "name": "trainer",
        "output_dir": str((config.output_dir / JOB_FOLDER).resolve()),
        "backend": "local",
        # Each rank's restarts and each re-rendezvous, with room for a master take-over.
        "max_restarts": 4 * max_restarts + 1,
        **job_timing(world_size),
        "roles": trainer_roles(config, world_size, max_restarts),
    }
    return parse_job(data, source="python -m rlplex.multirun.trainer")


def ask_trainer_to_stop(output_dir: Path, job_id: str, token: bytes, timeout_s: float = 0.25) -> None:
    """Ask every running rank of the trainer to stop gracefully (`ElasticWorker.request_stop`).
    Nothing is asked while a rank is not running (restarting: it is told by its environment once
    it starts, as the worker remembers the request) or once every rank is done."""
    from rlplex.control.node.role_group import RoleGroup

    try:
        group = RoleGroup.of_job(output_dir, job_id, token, TRAINER_ROLE, timeout_s=timeout_s)
    except WaitTimeoutError:
        return
    try:
        for future in group.call("request_stop"):
            try:
                future.result(timeout=30.0)
            except RlplexError as error:  # a rank that ended meanwhile
                log.info("trainer stop request not delivered: %s", error)
    finally:
        group.close()


class _GracefulStop:
    """The standalone trainer's signals: the first SIGTERM / SIGINT asks the ranks to stop
    gracefully (and again every `ASK_AGAIN_S` while they run); a second one stops the job at once."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        self.signals = 0
        self._asker: threading.Thread | None = None
        self._asked_at = float("-inf")

    def on_signal(self, signum: int) -> None:
        self.signals += 1
        if self.signals > 1:
            raise KeyboardInterrupt
        print(f"signal {signum}: asking the trainer to stop gracefully (again to stop at once)", file=sys.stderr)

    def tick(self, master: PrimeMaster) -> None:
        if not self.signals or time.monotonic() - self._asked_at < ASK_AGAIN_S:
            return
        if self._asker is not None and self._asker.is_alive():
            return
        # Off the control loop: the RPC may wait for a slow rank, and the loop must keep
        # taking heartbeats meanwhile.
        self._asked_at = time.monotonic()
        self._asker = threading.Thread(
            target=ask_trainer_to_stop, args=(self.output_dir, master.job_id, read_token(self.output_dir)), daemon=True
        )
        self._asker.start()


def run_trainer_job(config: TrainerConfig, world_size: int = 1, max_restarts: int = 3, out: TextIO = sys.stdout) -> int:
    """Run the trainer as a local control-plane job until it stops; its exit code: 0 when every
    rank ended cleanly (its steps done, idle, or stopped gracefully), 1 when the job failed
    (the cause is printed), 128 + the signal when a second signal stopped it at once."""
    spec = trainer_job_spec(config, world_size, max_restarts)
    stop = _GracefulStop(spec.output_dir)
    return run_local_job(spec, f"{TRAINER_ROLE}-0.log", out, on_signal=stop.on_signal, on_tick=stop.tick)
