"""From a `MainJobConfig` to the control-plane job that runs it.

Roles: `trainer` (ElasticWorkers, one per rank, each running `run_trainer(TrainerConfig)` in a
process of the round's group, the config passed as its JSON), `elastic` (the ElasticMaster of
their rendezvous), `orchestrator` (one node per run), `rollout` (the nodes that runs with
`rollout_workers > 1` generate on), `conductor` (the driver that plays events and ends the job),
and with `[inference] engine = "vllm"`, `inference` (one node running the
job's vLLM servers).
"""

from __future__ import annotations

from typing import Any

from rlplex.control.job.spec import JobSpec, parse_job
from rlplex.mainjob.config import MainJobConfig
from rlplex.mainjob.registry import rollout_slots
from rlplex.multirun.trainer.config import TrainerConfig

ROLLOUT_ROLE = "rollout"  # the role `rollout_node.RolloutNode` serves


def trainer_config(config: MainJobConfig) -> TrainerConfig:
    """The trainer's whole config; it reaches the trainer's processes as this model's JSON."""
    trainer = config.trainer
    return TrainerConfig(
        output_dir=config.runs_dir.resolve(),
        max_runs=trainer.max_runs,
        max_lora_rank=trainer.max_lora_rank,
        micro_tokens=trainer.micro_batch_tokens,
        checkpoint_every=trainer.checkpoint_every,
        model=config.model.resolved(),
        retention=trainer.retention,
        max_off_policy_steps=trainer.max_off_policy_steps,
        threads=1,
    )


def build_job_spec(config: MainJobConfig, source: str = "<main job>") -> JobSpec:
    trainer = config.trainer
    world = trainer.world_size
    rollout_restarts = 3 * len(rollout_slots([*config.runs, *config.later_runs]))
    data: dict[str, Any] = {
        "name": config.name,
        "output_dir": str(config.output_dir.resolve()),
        "backend": config.backend,
        "ray_address": config.ray_address,
        "max_restarts": 4 * (trainer.max_restarts + len(config.runs) + len(config.later_runs)) + rollout_restarts,
        # Small shares: on a 2-core laptop the processes take turns; placement still refuses
        # a trainer wider than the machine.
        "capacity": {"cpu": max(2.0, 0.5 * world + 1.0)},
        "heartbeat_interval_s": 0.5,
        # Every node imports torch before it reports ready: minutes on a busy 2-core machine.
        "start_timeout_s": 180.0,
        "rpc_timeout_s": 120.0,
        "roles": {
            "trainer": {
                "entrypoint": "rlplex.control.elastic:ElasticWorker",
                "count": world,
                "resources": {"cpu": 0.5},
                "restart": {"scope": "worker", "max_restarts": trainer.max_restarts},
                "heartbeat_timeout_s": 10.0,
                "config": {
                    "entrypoint": "rlplex.multirun.trainer:run_trainer",
                    "config": trainer_config(config).model_dump(mode="json"),
                    # A trainer told to stop checkpoints every run ahead of its last checkpoint.
                    "stop_grace_s": 15.0,
                },
            },
            "elastic": {
                "kind": "submaster",
                "entrypoint": "rlplex.control.elastic:ElasticMaster",
                "resources": {"cpu": 0.05},
                "restart": {"scope": "worker", "max_restarts": trainer.max_restarts},
                # A trainer node that dies is seen at once; silence means a hang. 30 s, not the
                # default 10: its agent thread can starve while the node imports torch and loads
                # the model on a busy machine (a node check failed at prepare that way).
                "config": {
                    "workers": "trainer",
                    "min_nodes": world,
                    "max_nodes": world,
                    "join_timeout_s": 60.0,
                    "member_timeout_s": 30.0,
                },
            },
            "orchestrator": {
                "entrypoint": "rlplex.mainjob.orchestrator_node:OrchestratorNode",
                "count": len(config.runs),
                "resources": {"cpu": 0.05},
                "restart": {"scope": "worker", "max_restarts": 3 * (len(config.runs) + len(config.later_runs))},
                "heartbeat_timeout_s": 10.0,
            },
            # The processes runs with `rollout_workers > 1` generate on (see `rollout_node`); a
            # run that joins later scales the role up.
            ROLLOUT_ROLE: {
                "entrypoint": "rlplex.mainjob.rollout_node:RolloutNode",
                "count": len(rollout_slots(config.runs)),
                "resources": {"cpu": 0.05},
                "restart": {"scope": "worker", "max_restarts": rollout_restarts},
                "heartbeat_timeout_s": 10.0,
            },
            "conductor": {
                "kind": "driver",
                "entrypoint": "rlplex.mainjob.conductor:conduct",
                "resources": {"cpu": 0.05},
                "config": {"job": config.model_dump(mode="json")},
            },
        },
    }
    if config.inference.engine == "vllm":
        data["roles"]["inference"] = {
            "entrypoint": "rlplex.mainjob.inference_node:InferenceNode",
            "resources": {"cpu": 0.05},
            "restart": {"scope": "worker", "max_restarts": config.inference.max_restarts},
            "heartbeat_timeout_s": 10.0,
            "config": {
                "inference": config.inference.model_dump(mode="json"),
                "model": config.model.resolved().model_dump(mode="json"),
            },
        }
        data["max_restarts"] += config.inference.max_restarts
    return parse_job(data, source)
