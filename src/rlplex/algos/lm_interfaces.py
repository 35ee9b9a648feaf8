"""Model interfaces that let the dataflow run GRPO on the tiny language model.

`GRPOActor` answers the `generate` and `train_step` MFCs (one model, policy version counted
per train step); `TaskReward` answers `rew_inf` with the task's verifiable reward. Each
datapoint is one sampled completion; `task_ids` carries the problem and its group (the
prompt it was sampled for), so advantages are computed within groups present in the batch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from rlplex.algos.grpo import grpo_loss
from rlplex.dataflow.mfc import MFCDef
from rlplex.models.lm import generate, left_pad, token_logprobs
from rlplex.tasks import CharTokenizer, Problem, Task


@dataclass(frozen=True)
class TaskItem:
    problem: Problem
    group: int


class GRPOActor:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: CharTokenizer,
        max_new_tokens: int,
        lr: float = 1e-3,
        clip: float = 0.2,
        epochs: int = 2,
        max_grad_norm: float = 1.0,
        seed: int = 0,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.clip, self.epochs, self.max_grad_norm = clip, epochs, max_grad_norm
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.generator = torch.Generator().manual_seed(seed)
        self.version = 0
        self.last_stats: dict[str, float] = {}

    def generate(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        rollouts = generate(
            self.model, self.tokenizer, inputs["packed_prompts"], self.max_new_tokens, generator=self.generator
        )
        tokens, logprobs, masks = [], [], []
        for row in range(len(inputs["packed_prompts"])):
            keep = rollouts.attention_B_L[row].bool()
            tokens.append(rollouts.tokens_B_L[row][keep])
            logprobs.append(rollouts.logprobs_B_L[row][keep])
            masks.append(rollouts.completion_mask_B_L[row][keep])
        return {"packed_input_ids": tokens, "packed_logprobs": logprobs, "prompt_mask": masks}

    def train_step(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        items: list[TaskItem] = inputs["task_ids"]
        rewards = torch.tensor(inputs["rewards"], dtype=torch.float32)
        advantages = torch.zeros_like(rewards)
        groups: dict[int, list[int]] = defaultdict(list)
        for position, item in enumerate(items):
            groups[item.group].append(position)
        for positions in groups.values():
            group_rewards = rewards[positions]
            std = group_rewards.std(unbiased=False) if len(positions) > 1 else torch.tensor(0.0)
            advantages[positions] = (group_rewards - group_rewards.mean()) / (std + 1e-6)
        tokens, attention = left_pad([t.tolist() for t in inputs["packed_input_ids"]], self.tokenizer.pad_id)
        width = tokens.shape[1]
        old = torch.zeros(tokens.shape)
        mask = torch.zeros(tokens.shape, dtype=torch.bool)
        for row, (logp, m) in enumerate(zip(inputs["packed_logprobs"], inputs["prompt_mask"], strict=True)):
            old[row, width - len(logp) :] = logp
            mask[row, width - len(m) :] = m
        self.model.train()
        stats: dict[str, float] = {}
        for _ in range(self.epochs):
            loss, stats = grpo_loss(token_logprobs(self.model, tokens, attention), old, advantages, mask, self.clip)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            self.optimizer.step()
        self.model.eval()
        self.version += 1
        self.last_stats = {**stats, "charts/reward_mean": float(rewards.mean()), "charts/policy_version": self.version}
        return {}


class TaskReward:
    def __init__(self, task: Task, tokenizer: CharTokenizer) -> None:
        self.task = task
        self.tokenizer = tokenizer

    def score(self, ids: torch.Tensor, item: TaskItem) -> float:
        prompt_len = len(self.tokenizer.encode(item.problem.prompt))
        return float(self.task.reward(item.problem, self.tokenizer.decode(ids[prompt_len:].tolist())))

    def inference(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        pairs = zip(inputs["packed_input_ids"], inputs["task_ids"], strict=True)
        return {"rewards": [self.score(ids, item) for ids, item in pairs]}
