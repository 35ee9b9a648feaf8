"""GRPO on a causal language model as a dataflow, synchronous or asynchronous (eta).

Rollout workers (threads here) generate groups of completions for a task and score them; the
trainer runs the `actor_train` MFC through the `FunctionExecutor` on trajectories from the
`StreamDataset`, then publishes the new policy version. eta bounds staleness; eta = 0 is
synchronous RL on the same path. Two engines generate:
- `inference.engine = "hf"` (default): each worker holds a copy of the model (all of its weights
  trained) and samples with transformers; a version is a state dict;
- `inference.engine = "vllm"`: the policy is a LoRA adapter (`lora_rank`) of the frozen model,
  served by a vLLM server this runner starts; a version is a PEFT folder each worker loads into
  the server under its own name (see `rlplex.runners.grpo_vllm`).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field

from rlplex.algos.lm_interfaces import EnvReward, GRPOActor, group_samples
from rlplex.config import StrictModel
from rlplex.dataflow import FunctionExecutor, LocalModelWorker, MFCDef, ModelInterfaceType, build_graph
from rlplex.dataflow.stream import (
    RolloutWorker,
    StalenessController,
    StreamDataset,
    WaitCounters,
    WeightBroadcaster,
)
from rlplex.diagnostics import MetricsLogger, ProgressLine
from rlplex.errors import RlplexError
from rlplex.inference.config import InferenceConfig
from rlplex.models.hf import Tokenizer, encode_prompt, load_causal_lm, load_tokenizer
from rlplex.models.lm import generate, mean_reward
from rlplex.models.spec import ModelSpec
from rlplex.runners.grpo_vllm import ServedLoRAPolicy, served_rollout_worker
from rlplex.tasks import Environment, EnvSpec, load_environment

TRAIN_KEYS = ("packed_input_ids", "packed_logprobs", "prompt_mask", "rewards", "task_ids", "version_start")


class GRPOLMConfig(StrictModel):
    model: ModelSpec = Field(description="The model to train (all its weights): a hub id or a local folder.")
    env: EnvSpec = EnvSpec(name="reverse")
    batch_size: int = Field(128, ge=1, description="samples per train step")
    group_size: int = Field(8, ge=2, description="completions per prompt")
    eta: int = Field(1, ge=0, description="maximum policy versions between generation and training")
    rollout_workers: int = Field(1, ge=1)
    lr: float = Field(1e-3, gt=0)
    epochs: int = Field(2, ge=1)
    steps: int = Field(60, ge=1)
    eval_every: int = Field(10, ge=1)
    eval_samples: int = Field(256, ge=1)
    target_reward: float | None = None
    seed: int = 0
    inference: InferenceConfig = Field(InferenceConfig(), description="'hf': in-process; 'vllm': a server")
    lora_rank: int = Field(8, ge=1, description="with engine 'vllm': rank of the trained LoRA adapter")


@dataclass
class GRPOResult:
    steps: int
    wall_time_s: float
    initial_reward: float
    final_reward: float
    curve: list[tuple[int, float, float]] = field(default_factory=list)  # (step, eval reward, seconds)
    max_staleness: int = 0
    target_reached_at_s: float | None = None
    waits: dict[str, float] = field(default_factory=dict)


class _StalenessTracker:
    def __init__(self, actor: GRPOActor) -> None:
        self.actor = actor
        self.max_staleness = 0

    def observe(self, version_starts: list[int]) -> None:
        self.max_staleness = max(self.max_staleness, self.actor.version - min(version_starts))


class _TrainInterface:
    """The trainer's side of `actor_train`: checks staleness, steps, publishes weights."""

    def __init__(
        self,
        actor: GRPOActor,
        tracker: _StalenessTracker,
        weights: WeightBroadcaster,
        controller: StalenessController,
        snapshot: Callable[[int], dict[str, Any]],
    ) -> None:
        self.actor, self.tracker, self.weights, self.controller = actor, tracker, weights, controller
        self.snapshot = snapshot

    def train_step(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        self.tracker.observe(inputs["version_start"])
        out = self.actor.train_step(mfc, inputs)
        self.weights.publish(self.actor.version, self.snapshot(self.actor.version))
        self.controller.set_version(self.actor.version)
        return out


def _train_graph(batch_size: int) -> Any:
    mfc = MFCDef("actor_train", "actor", ModelInterfaceType.TRAIN_STEP, TRAIN_KEYS, (), batch_size)
    return build_graph([mfc], dataset_keys=TRAIN_KEYS)


def train_grpo_lm(config: GRPOLMConfig, log_dir: str | Path | None = None, show_progress: bool = False) -> GRPOResult:
    if config.batch_size % config.group_size:
        raise RlplexError(
            f"field 'batch_size': {config.batch_size} is not a multiple of group_size {config.group_size}"
        )
    torch.manual_seed(config.seed)
    tokenizer, task = load_tokenizer(config.model), load_environment(config.env)
    model: torch.nn.Module = load_causal_lm(config.model).requires_grad_(True)
    served: ServedLoRAPolicy | None = None
    if config.inference.engine == "vllm":
        work_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="rlplex-grpo-vllm-"))
        served = ServedLoRAPolicy(config.model, model, config.inference, config.lora_rank, work_dir)
        model = served.module
    actor = GRPOActor(model, tokenizer, task.max_new_tokens, lr=config.lr, epochs=config.epochs, seed=config.seed)
    reward_model = EnvReward(task, tokenizer)
    waits = WaitCounters()
    controller = StalenessController(config.batch_size, config.eta, waits)
    stream = StreamDataset(capacity=(config.eta + 1) * config.batch_size, waits=waits)
    weights = WeightBroadcaster()
    tracker = _StalenessTracker(actor)
    counter = itertools.count()
    counter_lock = threading.Lock()

    def next_group() -> int:
        with counter_lock:
            return next(counter)

    if served is None:
        workers = [
            _make_rollout_worker(i, config, model, tokenizer, task, reward_model, controller, stream, weights,
                                 next_group)
            for i in range(config.rollout_workers)
        ]  # fmt: skip
    else:
        try:
            served.start()
            served.export(0)
            workers = [
                served_rollout_worker(i, config.seed, config.group_size, served, tokenizer, task, reward_model,
                                      controller, stream, weights, next_group)
                for i in range(config.rollout_workers)
            ]  # fmt: skip
        except BaseException:
            served.close()
            raise

    def snapshot(version: int) -> dict[str, Any]:
        if served is not None:
            return {"adapter_dir": str(served.export(version))}
        return {k: v.detach().clone() for k, v in actor.model.state_dict().items()}

    def trajectories() -> Iterator[dict[str, Any]]:
        while True:
            trajectory = stream.get(timeout=600)
            yield {**trajectory.data, "version_start": trajectory.version_start}

    train_worker = LocalModelWorker("trainer", _TrainInterface(actor, tracker, weights, controller, snapshot))
    executor = FunctionExecutor(
        _train_graph(config.batch_size),
        {"actor": [train_worker]},
        trajectories(),
        capacity=config.batch_size,
        step_timeout=600,
    )
    logger = MetricsLogger(log_dir) if log_dir is not None else None
    progress = ProgressLine(config.steps, f"grpo eta={config.eta}", enabled=show_progress)
    initial = mean_reward(model, tokenizer, task, config.eval_samples, seed=10_000 + config.seed)
    result = GRPOResult(
        steps=0, wall_time_s=0.0, initial_reward=initial, final_reward=initial, curve=[(0, initial, 0.0)]
    )
    t0 = time.perf_counter()
    loop = asyncio.new_event_loop()  # one loop for the run: the buffer's events belong to it
    for worker in workers:
        worker.start()
    try:
        for step in range(1, config.steps + 1):
            metrics = loop.run_until_complete(executor.execute_step())
            for worker in workers:
                if worker.error is not None:
                    raise RlplexError(f"rollout worker {worker.name} failed: {worker.error!r}") from worker.error
            row = {
                **metrics,
                **actor.last_stats,
                **waits.metrics(),
                "charts/max_staleness": float(tracker.max_staleness),
            }
            if step % config.eval_every == 0 or step == config.steps:
                elapsed = time.perf_counter() - t0
                reward = mean_reward(model, tokenizer, task, config.eval_samples, seed=10_000 + config.seed)
                result.curve.append((step, reward, elapsed))
                row["charts/eval_reward"] = reward
                if (
                    config.target_reward is not None
                    and reward >= config.target_reward
                    and result.target_reached_at_s is None
                ):
                    result.target_reached_at_s = elapsed
            if logger is not None:
                logger.log(step, row)
            progress.update(step, {"reward": actor.last_stats.get("charts/reward_mean", 0.0)})
            result.steps = step
            if result.target_reached_at_s is not None:
                break
    finally:
        controller.close()
        stream.close()
        for worker in workers:
            worker.join(timeout=30)
        train_worker.close()
        loop.close()
        if served is not None:
            served.close()
        progress.close()
        if logger is not None:
            logger.close()
    result.wall_time_s = time.perf_counter() - t0
    result.final_reward = result.curve[-1][1]
    result.max_staleness = tracker.max_staleness
    result.waits = waits.metrics()
    return result


def _make_rollout_worker(
    index: int,
    config: GRPOLMConfig,
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    task: Environment,
    reward_model: EnvReward,
    controller: StalenessController,
    stream: StreamDataset,
    weights: WeightBroadcaster,
    next_group: Any,
) -> RolloutWorker:
    local_model = copy.deepcopy(model).eval()
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(config.seed * 1000 + index)

    def rollout(group: int) -> list[dict[str, Any]]:
        example = task.sample(1, np.random.default_rng((config.seed, group)))[0]
        prompts = [encode_prompt(tokenizer, example)] * config.group_size
        rollouts = generate(local_model, tokenizer, prompts, task.max_new_tokens, generator=generator).cpu()
        keep = rollouts.attention_B_L.bool()
        rows = range(config.group_size)
        ids = [rollouts.tokens_B_L[row][keep[row]] for row in rows]
        masks = [rollouts.completion_mask_B_L[row][keep[row]] for row in rows]
        logprobs = [rollouts.logprobs_B_L[row][keep[row]] for row in rows]
        return group_samples(reward_model, example, group, ids, logprobs, masks)

    return RolloutWorker(
        f"rollout{index}",
        rollout,
        local_model.load_state_dict,
        config.group_size,
        controller,
        stream,
        weights,
        next_group,
    )
