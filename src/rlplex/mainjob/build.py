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
from rlplex.multirun.trainer.job import job_timing, trainer_roles

ROLLOUT_ROLE = "rollout"  # the role `rollout_node.RolloutNode` serves
ORCHESTRATOR_ROLE = "orchestrator"  # one `orchestrator_node.OrchestratorNode` per run
# What the orchestrator and rollout nodes import anyway (a tokenizer, a model, TensorBoard), once
# for all of them: the local backend forks every node from a server that has these loaded.
NODE_PRELOAD = [
    "torch",
    "torch.utils.tensorboard",
    "transformers",
    "transformers.models.auto.auto_factory",
    "transformers.modeling_layers",
    "rlplex.multirun.orchestrator.loop",
    "rlplex.mainjob.orchestrator_node",
    "rlplex.mainjob.rollout_node",
    "rlplex.mainjob.conductor",
    "rlplex.mainjob.inference_node",
    "rlplex.control.elastic",
]


RESTARTS_PER_RUN = 3
"""Crashes of a run's orchestrator (or rollout node) healed before the job fails."""


def trainer_config(config: MainJobConfig) -> TrainerConfig:
    """The trainer's whole config; it reaches the trainer's processes as this model's JSON."""
    trainer = config.trainer
    return TrainerConfig(
        output_dir=config.runs_dir.resolve(),
        max_runs=trainer.max_runs,
        max_lora_rank=trainer.max_lora_rank,
        target_modules=tuple(trainer.target_modules) if trainer.target_modules is not None else None,
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
    # Three restarts per node, as its budget grows with each run added while the job runs
    # (`later_runs` and `rlplex runs add` scale the roles up).
    rollout_restarts = RESTARTS_PER_RUN * len(rollout_slots(config.runs))
    data: dict[str, Any] = {
        "name": config.name,
        "output_dir": str(config.output_dir.resolve()),
        "backend": config.backend,
        "ray_address": config.ray_address,
        "max_restarts": 4 * (trainer.max_restarts + len(config.runs)) + rollout_restarts,
        **job_timing(world),
        "preload": NODE_PRELOAD,
        "roles": {
            **trainer_roles(trainer_config(config), world, trainer.max_restarts),
            ORCHESTRATOR_ROLE: {
                "entrypoint": "rlplex.mainjob.orchestrator_node:OrchestratorNode",
                "count": len(config.runs),
                "resources": {"cpu": 0.05},
                "restart": {
                    "scope": "worker",
                    "max_restarts": RESTARTS_PER_RUN * len(config.runs),
                    "per_node": RESTARTS_PER_RUN,
                },
                "heartbeat_timeout_s": 10.0,
            },
            # The processes runs with `rollout_workers > 1` generate on (see `rollout_node`); a
            # run that joins later scales the role up.
            ROLLOUT_ROLE: {
                "entrypoint": "rlplex.mainjob.rollout_node:RolloutNode",
                "count": len(rollout_slots(config.runs)),
                "resources": {"cpu": 0.05},
                "restart": {"scope": "worker", "max_restarts": rollout_restarts, "per_node": RESTARTS_PER_RUN},
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
