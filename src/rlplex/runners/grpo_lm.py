"""GRPO on a causal language model as a dataflow, synchronous or asynchronous (eta).

Rollout workers (threads here) generate groups of completions for a task and score them; the
trainer runs the `actor_train` MFC through the `FunctionExecutor` on trajectories from the
`StreamDataset`, then publishes the new policy version. eta bounds staleness; eta = 0 is
synchronous RL on the same path. The bound is enforced where samples are trained: a sample
generated more than eta versions before the trainer's version (a straggler's) is dropped,
counted (`charts/dropped_stale`) and replaced (`fresh_trajectories`).

`decoupled = true` trains with AReaL's decoupled PPO objective: an `actor_prox` MFC on the
trainer recomputes each sequence's log-probabilities under the weights it holds before the
step (the proximal policy); `actor_train` takes its clipped ratio against them and weights by
proximal/behaviour, capped at `behav_imp_weight_cap`.

    stream --fresh_trajectories--> [actor_prox: proximal_logprobs] --> actor_train --> weights

With a log folder and `checkpoint_every`, snapshots (`snapshots/itr_N`, safetensors + JSON)
hold the weights, optimizer, policy version, staleness counters, the stream's finished
trajectories and the groups in flight; `resume=True` continues from the newest, generating
the in-flight groups again. Two engines generate:
- `inference.engine = "hf"` (default): each worker holds a copy of the model (all of its weights
  trained) and samples with transformers; a version is a state dict;
- `inference.engine = "vllm"`: the policy is a LoRA adapter (`lora_rank`) of the frozen model,
  served by a vLLM server this runner starts; a version is a PEFT folder each worker loads into
  the server under its own name (see `rlplex.runners.grpo_vllm`).
"""

from __future__ import annotations

import asyncio
import copy
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field

from rlplex.algos.lm_interfaces import EnvReward, GRPOActor, TaskItem, group_samples
from rlplex.config import StrictModel
from rlplex.dataflow import FunctionExecutor, LocalModelWorker, MFCDef, ModelInterfaceType, build_graph
from rlplex.dataflow.stream import (
    RolloutWorker,
    StalenessController,
    StreamDataset,
    WaitCounters,
    WeightBroadcaster,
    fresh_trajectories,
)
from rlplex.diagnostics import MetricsLogger, ProgressLine
from rlplex.errors import RlplexError, SnapshotError
from rlplex.inference.config import InferenceConfig, resolve_engine
from rlplex.io.snapshot import (
    check_compatible,
    latest_snapshot,
    read_snapshot,
    rng_state,
    save_by_mode,
    set_rng_state,
)
from rlplex.models.hf import Tokenizer, encode_prompt, load_causal_lm, load_tokenizer
from rlplex.models.lm import generate, mean_reward
from rlplex.models.spec import ModelSpec
from rlplex.runners.grpo_vllm import ServedLoRAPolicy, served_rollout_worker
from rlplex.tasks import Environment, EnvSpec, Example, load_environment

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
    inference: InferenceConfig = Field(
        InferenceConfig(), description="'auto': vLLM on a CUDA GPU, else 'hf'; 'hf': in-process; 'vllm': a server"
    )
    lora_rank: int = Field(8, ge=1, description="with engine 'vllm': rank of the trained LoRA adapter")
    decoupled: bool = Field(
        False, description="decoupled PPO: clip against recomputed proximal log-probs, re-weight by behaviour"
    )
    behav_imp_weight_cap: float | None = Field(
        5.0, gt=1.0, description="with decoupled: tokens whose proximal/behaviour weight exceeds this get weight 0"
    )
    checkpoint_every: int | None = Field(
        None, ge=1, description="with a log folder: snapshot every N steps and at the end (the newest is kept)"
    )


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
    dropped_stale: int = 0  # samples too stale to train when their turn came, regenerated


class _StalenessTracker:
    def __init__(self, actor: GRPOActor, eta: int) -> None:
        self.actor, self.eta = actor, eta
        self.max_staleness = 0

    def observe(self, version_starts: list[int]) -> None:
        staleness = self.actor.version - min(version_starts)
        if staleness > self.eta:  # `fresh_trajectories` drops these: reaching here is a bug
            raise RlplexError(f"a sample {staleness} versions old reached training (eta {self.eta})")
        self.max_staleness = max(self.max_staleness, staleness)


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

    def inference(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        return self.actor.inference(mfc, inputs)

    def train_step(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        self.tracker.observe(inputs["version_start"])
        out = self.actor.train_step(mfc, inputs)
        self.weights.publish(self.actor.version, self.snapshot(self.actor.version))
        self.controller.set_version(self.actor.version)
        return out


def train_graph(batch_size: int, decoupled: bool = False) -> Any:
    """The trainer's MFCs: `actor_train`, after `actor_prox` when the objective is decoupled."""
    if not decoupled:
        mfc = MFCDef("actor_train", "actor", ModelInterfaceType.TRAIN_STEP, TRAIN_KEYS, (), batch_size)
        return build_graph([mfc], dataset_keys=TRAIN_KEYS)
    prox = MFCDef(
        "actor_prox", "actor", ModelInterfaceType.INFERENCE, ("packed_input_ids",), ("proximal_logprobs",), batch_size
    )
    train = MFCDef(
        "actor_train", "actor", ModelInterfaceType.TRAIN_STEP, (*TRAIN_KEYS, "proximal_logprobs"), (), batch_size
    )
    return build_graph([prox, train], dataset_keys=TRAIN_KEYS)


def train_grpo_lm(
    config: GRPOLMConfig, log_dir: str | Path | None = None, show_progress: bool = False, resume: bool = False
) -> GRPOResult:
    """Train; with `resume`, continue from the newest snapshot in `log_dir` up to `config.steps`."""
    if config.batch_size % config.group_size:
        raise RlplexError(
            f"field 'batch_size': {config.batch_size} is not a multiple of group_size {config.group_size}"
        )
    if (resume or config.checkpoint_every is not None) and log_dir is None:
        raise RlplexError("checkpoints and resume need a log folder (log_dir)")
    source = latest_snapshot(Path(log_dir) / "snapshots") if resume and log_dir is not None else None
    saved = read_snapshot(source) if source is not None else None
    torch.manual_seed(config.seed)
    tokenizer, task = load_tokenizer(config.model), load_environment(config.env)
    model: torch.nn.Module = load_causal_lm(config.model).requires_grad_(True)
    served: ServedLoRAPolicy | None = None
    if resolve_engine(config.inference.engine, config.model.device) == "vllm":
        work_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="rlplex-grpo-vllm-"))
        served = ServedLoRAPolicy(config.model, model, config.inference, config.lora_rank, work_dir)
        model = served.module
    actor = GRPOActor(
        model,
        tokenizer,
        task.max_new_tokens,
        lr=config.lr,
        epochs=config.epochs,
        seed=config.seed,
        behav_imp_weight_cap=config.behav_imp_weight_cap,
    )
    reward_model = EnvReward(task, tokenizer)
    waits = WaitCounters()
    controller = StalenessController(config.batch_size, config.eta, waits)
    stream = StreamDataset(capacity=(config.eta + 1) * config.batch_size, waits=waits)
    weights = WeightBroadcaster()
    tracker = _StalenessTracker(actor, config.eta)
    if source is not None and saved is not None:
        _restore(source, saved, config, actor, controller, stream, tracker, task)
    version = actor.version

    if served is None:
        workers = [
            _make_rollout_worker(i, config, model, tokenizer, task, reward_model, controller, stream, weights)
            for i in range(config.rollout_workers)
        ]
    else:
        try:
            served.start()
            served.export(version)
            workers = [
                served_rollout_worker(i, config.seed, config.group_size, served, tokenizer, task, reward_model,
                                      controller, stream, weights, version)
                for i in range(config.rollout_workers)
            ]  # fmt: skip
        except BaseException:
            served.close()
            raise

    def snapshot(version: int) -> dict[str, Any]:
        if served is not None:
            return {"adapter_dir": str(served.export(version))}
        return {k: v.detach().clone() for k, v in actor.model.state_dict().items()}

    if version > 0:
        weights.publish(version, snapshot(version))

    def trajectories() -> Iterator[dict[str, Any]]:
        for trajectory in fresh_trajectories(stream, controller, timeout=600):
            yield {**trajectory.data, "version_start": trajectory.version_start}

    train_worker = LocalModelWorker("trainer", _TrainInterface(actor, tracker, weights, controller, snapshot))
    executor = FunctionExecutor(
        train_graph(config.batch_size, config.decoupled),
        {"actor": [train_worker]},
        trajectories(),
        capacity=config.batch_size,
        step_timeout=600,
    )
    logger = MetricsLogger(log_dir) if log_dir is not None else None
    progress = ProgressLine(config.steps, f"grpo eta={config.eta}", enabled=show_progress)
    if saved is None:
        initial = mean_reward(model, tokenizer, task, config.eval_samples, seed=10_000 + config.seed)
        result = GRPOResult(
            steps=0, wall_time_s=0.0, initial_reward=initial, final_reward=initial, curve=[(0, initial, 0.0)]
        )
    else:
        result = _result_from(saved["result"])
    elapsed_before = result.wall_time_s
    t0 = time.perf_counter()
    loop = asyncio.new_event_loop()  # one loop for the run: the buffer's events belong to it
    for worker in workers:
        worker.start()
    try:
        for step in range(result.steps + 1, config.steps + 1):
            metrics = loop.run_until_complete(executor.execute_step())
            for worker in workers:
                if worker.error is not None:
                    raise RlplexError(f"rollout worker {worker.name} failed: {worker.error!r}") from worker.error
            row = {
                **metrics,
                **actor.last_stats,
                **waits.metrics(),
                "charts/max_staleness": float(tracker.max_staleness),
                "charts/dropped_stale": float(controller.rejected),
            }
            if step % config.eval_every == 0 or step == config.steps:
                elapsed = elapsed_before + time.perf_counter() - t0
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
            result.max_staleness, result.dropped_stale = tracker.max_staleness, controller.rejected
            done = result.target_reached_at_s is not None
            every = config.checkpoint_every
            if log_dir is not None and every is not None and (step % every == 0 or step == config.steps or done):
                result.wall_time_s = elapsed_before + time.perf_counter() - t0
                state = _checkpoint(actor, controller, stream, result)
                save_by_mode(Path(log_dir) / "snapshots", step, state, "last", 1)
            if done:
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
    result.wall_time_s = elapsed_before + time.perf_counter() - t0
    result.final_reward = result.curve[-1][1]
    result.max_staleness, result.dropped_stale = tracker.max_staleness, controller.rejected
    result.waits = waits.metrics()
    return result


def _checkpoint(
    actor: GRPOActor, controller: StalenessController, stream: StreamDataset, result: GRPOResult
) -> dict[str, Any]:
    """Everything a resume needs, taken between steps (the trainer idle, the buffer empty)."""
    stream_state = stream.state_dict()  # the workers keep running: one consistent cut
    for item in stream_state["items"]:
        # The example is derived from the group number again on resume (`_group_example`).
        item["data"] = {**item["data"], "task_ids": item["data"]["task_ids"].group}
    return {
        "format": "rlplex.grpo_lm/1",
        "model": {k: v.detach().cpu() for k, v in actor.model.state_dict().items()},
        "optimizer": actor.optimizer.state_dict(),
        "version": actor.version,
        "generator": actor.generator.get_state(),
        "rng": rng_state(),
        "controller": controller.state_dict(),
        "stream": stream_state,
        "result": {
            "steps": result.steps,
            "wall_time_s": result.wall_time_s,
            "initial_reward": result.initial_reward,
            "curve": [list(point) for point in result.curve],
            "max_staleness": result.max_staleness,
            "dropped_stale": result.dropped_stale,
            "target_reached_at_s": result.target_reached_at_s,
        },
    }


def _restore(
    source: Path,
    state: dict[str, Any],
    config: GRPOLMConfig,
    actor: GRPOActor,
    controller: StalenessController,
    stream: StreamDataset,
    tracker: _StalenessTracker,
    task: Environment,
) -> None:
    if state.get("format") != "rlplex.grpo_lm/1":
        raise SnapshotError(f"{source}: not a GRPO runner snapshot (format {state.get('format')!r})")
    check_compatible(actor.model.state_dict(), state["model"], source)
    actor.model.load_state_dict(state["model"])
    actor.optimizer.load_state_dict(state["optimizer"])
    actor.version = int(state["version"])
    actor.generator.set_state(state["generator"])
    set_rng_state(state["rng"])
    stream_state = state["stream"]
    for item in stream_state["items"]:
        group = int(item["data"]["task_ids"])
        item["data"] = {**item["data"], "task_ids": TaskItem(_group_example(task, config.seed, group)[0], group)}
    stream.load_state_dict(stream_state)
    # In-flight groups are generated again and admitted again, so only what is trained or
    # waiting in the stream counts as started: the allowance is exactly what it was.
    controller.load_state_dict(
        {
            "version": actor.version,
            "started": actor.version * config.batch_size + len(stream_state["items"]),
            "rejected": int(state["controller"]["rejected"]),
        }
    )
    tracker.max_staleness = int(state["result"]["max_staleness"])


def _result_from(saved: dict[str, Any]) -> GRPOResult:
    curve = [(int(s), float(r), float(t)) for s, r, t in saved["curve"]]
    return GRPOResult(
        steps=int(saved["steps"]),
        wall_time_s=float(saved["wall_time_s"]),
        initial_reward=float(saved["initial_reward"]),
        final_reward=curve[-1][1],
        curve=curve,
        max_staleness=int(saved["max_staleness"]),
        dropped_stale=int(saved["dropped_stale"]),
        target_reached_at_s=saved["target_reached_at_s"],
    )


def _group_example(task: Environment, seed: int, group: int) -> tuple[Example, int]:
    """A group's prompt, and the seed of its sampling: a function of the group number alone, so
    that a group generated again after a restart asks the same question."""
    rng = np.random.default_rng((seed, group))
    return task.sample(1, rng)[0], int(rng.integers(2**62))


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
) -> RolloutWorker:
    local_model = copy.deepcopy(model).eval()
    generator = torch.Generator(device=next(model.parameters()).device)

    def rollout(group: int) -> list[dict[str, Any]]:
        example, sample_seed = _group_example(task, config.seed, group)
        generator.manual_seed(sample_seed)
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
    )
