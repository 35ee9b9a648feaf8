"""The seed's synchronous PPO step as a dataflow of model function calls (MFCs).

    actor_gen ──► ref_inf ──┐
        │                   ├──► actor_train
        └──────► rew_inf ───┘

`rlplex.dataflow.ppo_graph` declares the four MFCs and the keys they read and write; the
`FunctionExecutor` runs each MFC as soon as its inputs are in the `SequenceBuffer`, so
`ref_inf` and `rew_inf` overlap. Three model workers answer the calls: the actor (any Hugging
Face causal LM: `--model` names a hub id or a local folder; by default the tiny checkpoint,
built once with `rlplex model tiny`), a frozen copy of it as the reference model, and the
environment's reward. The actor is trained with the clipped PPO objective, advantages
normalised over the batch (the seed's graph has no critic), and a KL penalty to the
reference model. Each step prints its reward and how long each MFC ran and waited.

    python examples/ppo_dataflow.py --steps 20 --output-dir outputs/ppo_dataflow [--model NAME]

Writes progress.csv (one row per step), TensorBoard files (tb/) and learning_curve.png.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlplex.algos.grpo import grpo_loss
from rlplex.algos.lm_interfaces import EnvReward, GRPOActor, TaskItem
from rlplex.algos.rl_math import group_advantages
from rlplex.dataflow import FunctionExecutor, LocalModelWorker, MFCDef, ppo_graph
from rlplex.diagnostics import plot_learning_curves
from rlplex.diagnostics.metrics import MetricsLogger
from rlplex.models.hf import Tokenizer, encode_prompt, load_causal_lm, load_tokenizer
from rlplex.models.lm import left_pad, pad_id_of, token_logprobs
from rlplex.models.spec import ModelSpec
from rlplex.models.tiny import TinyModelConfig, build_tiny_model, read_tiny_settings
from rlplex.tasks import Environment, environment_names, load_environment

MFCS = ("actor_gen", "ref_inf", "rew_inf", "actor_train")


def tiny_model_for(task: str) -> Path:
    """`outputs/models/tiny-<task>`: a tiny model warmed up on `task` that is already there
    (`make demo` builds one with more warm-up steps) is used as it is; else one is built."""
    folder = Path("outputs/models") / f"tiny-{task}"
    found = read_tiny_settings(folder)
    settings = found.get("settings") if found else None
    if isinstance(settings, dict) and task in settings.get("tasks", ()):
        return folder.resolve()
    return build_tiny_model(folder, TinyModelConfig(tasks=(task,)))


def padded_logprobs(model: torch.nn.Module, sequences: list[torch.Tensor], pad_id: int) -> torch.Tensor:
    """log p(token_t | tokens_<t) of every sequence, left-padded to one matrix."""
    tokens, attention = left_pad([s.tolist() for s in sequences], pad_id)
    device = next(model.parameters()).device
    return token_logprobs(model, tokens.to(device), attention.to(device)).cpu()


class ReferenceModel:
    """`ref_inf`: the log-probabilities of each sequence under the frozen reference policy."""

    def __init__(self, model: torch.nn.Module, pad_id: int) -> None:
        self.model = model.eval().requires_grad_(False)
        self.pad_id = pad_id

    @torch.no_grad()
    def inference(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        sequences = inputs["packed_input_ids"]
        logprobs = padded_logprobs(self.model, sequences, self.pad_id)
        width = logprobs.shape[1]
        return {"packed_ref_logprobs": [logprobs[row, width - len(s) :] for row, s in enumerate(sequences)]}


class PPOActor(GRPOActor):
    """`actor_gen` (inherited: sample one completion per prompt) and `actor_train` (PPO + KL to the reference)."""

    def __init__(
        self, model: torch.nn.Module, tokenizer: Tokenizer, max_new_tokens: int, kl_coef: float, **kwargs: Any
    ) -> None:
        super().__init__(model, tokenizer, max_new_tokens, **kwargs)
        self.kl_coef = kl_coef

    def train_step(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        rewards = torch.tensor(inputs["rewards"], dtype=torch.float32)
        advantages = group_advantages(rewards, len(rewards))  # the whole batch as one group
        sequences = inputs["packed_input_ids"]
        tokens, attention = left_pad([s.tolist() for s in sequences], pad_id_of(self.tokenizer))
        width = tokens.shape[1]
        old, ref = torch.zeros(tokens.shape), torch.zeros(tokens.shape)
        mask = torch.zeros(tokens.shape, dtype=torch.bool)
        for row, seq in enumerate(sequences):
            old[row, width - len(seq) :] = inputs["packed_logprobs"][row]
            ref[row, width - len(seq) :] = inputs["packed_ref_logprobs"][row]
            mask[row, width - len(seq) :] = inputs["prompt_mask"][row]
        device = next(self.model.parameters()).device
        tokens, attention, old, ref, mask, advantages = (
            t.to(device) for t in (tokens, attention, old, ref, mask, advantages)
        )
        n_tokens = mask.sum().clamp(min=1)
        self.model.train()
        kl_before = float("nan")
        stats: dict[str, float] = {}
        for epoch in range(self.epochs):
            logprobs = token_logprobs(self.model, tokens, attention)
            loss, stats = grpo_loss(logprobs, old, advantages, mask, self.clip)
            # k3 estimator of KL(actor || reference) over completion tokens: >= 0, low variance.
            log_ratio = ref - logprobs
            kl = ((log_ratio.exp() - log_ratio - 1) * mask).sum() / n_tokens
            if epoch == 0:
                kl_before = float(kl.detach())
            self.optimizer.zero_grad(set_to_none=True)
            (loss + self.kl_coef * kl).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            self.optimizer.step()
        self.model.eval()
        self.version += 1
        self.last_stats = {
            **stats,
            "losses/kl_to_ref": kl_before,
            "charts/reward_mean": float(rewards.mean()),
            "charts/policy_version": float(self.version),
        }
        return {}


def prompts(env: Environment, tokenizer: Tokenizer, seed: int) -> Iterator[dict[str, Any]]:
    """The dataset: one fresh example per datapoint (`task_ids` carries it to the reward model)."""
    rng = np.random.default_rng(seed)
    for index in itertools.count():
        example = env.sample(1, rng)[0]
        yield {"packed_prompts": encode_prompt(tokenizer, example), "task_ids": TaskItem(example, index)}


async def train(executor: FunctionExecutor, actor: PPOActor, steps: int, logger: MetricsLogger) -> None:
    header = f"{'step':>4} {'reward':>7} {'kl_ref':>7} " + " ".join(f"{m + ' s':>14}" for m in MFCS) + f" {'step s':>7}"
    print(header, flush=True)
    for step in range(1, steps + 1):
        metrics = await executor.execute_step()
        metrics.update(actor.last_stats)
        logger.log(step, metrics)
        runs = " ".join(f"{metrics[f'timings/{m}_run_s']:>14.3f}" for m in MFCS)
        print(
            f"{step:>4} {metrics['charts/reward_mean']:>7.3f} {metrics['losses/kl_to_ref']:>7.4f} {runs}"
            f" {metrics['timings/step_s']:>7.2f}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="PPO steps (each runs the four MFCs once)")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/ppo_dataflow"))
    parser.add_argument("--model", default=None, help="hub id or local folder (default: the tiny checkpoint)")
    parser.add_argument("--task", default="reverse", choices=environment_names(), help="the environment")
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per step (and per MFC call)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--kl-coef", type=float, default=0.05, help="weight of KL(actor || reference) in the loss")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1:
        parser.error("--steps and --batch-size must be at least 1")

    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    name = args.model or str(tiny_model_for(args.task))
    spec = ModelSpec(name=name)
    tokenizer, env = load_tokenizer(spec), load_environment(args.task)
    model = load_causal_lm(spec).requires_grad_(True)
    print(f"model {name}: ready in {time.perf_counter() - t0:.1f} s", flush=True)
    actor = PPOActor(model, tokenizer, env.max_new_tokens, lr=args.lr, kl_coef=args.kl_coef, seed=args.seed)
    workers = {
        "actor": [LocalModelWorker("actor0", actor)],
        "ref": [LocalModelWorker("ref0", ReferenceModel(copy.deepcopy(model), pad_id_of(tokenizer)))],
        "reward": [LocalModelWorker("reward0", EnvReward(env, tokenizer))],
    }
    dataset = prompts(env, tokenizer, args.seed + 1)
    executor = FunctionExecutor(ppo_graph(args.batch_size), workers, dataset, step_timeout=300)
    try:
        with MetricsLogger(args.output_dir) as logger:
            asyncio.run(train(executor, actor, args.steps, logger))
            rows = logger.rows
    finally:
        for group in workers.values():
            for worker in group:
                worker.close()
    steps = [row["step"] for row in rows]
    rewards = [row["charts/reward_mean"] for row in rows]
    png = plot_learning_curves(
        {"batch reward": (steps, rewards)},
        args.output_dir / "learning_curve.png",
        title=f"PPO dataflow on '{args.task}'",
        xlabel="PPO steps",
        ylabel="mean reward",
    )
    print(f"reward {rewards[0]:.3f} -> {rewards[-1]:.3f} over {len(rows)} steps")
    print(f"wrote {args.output_dir / 'progress.csv'}, {args.output_dir / 'tb'}, {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
