"""Model interfaces that let the dataflow run GRPO on any causal language model.

`GRPOActor` answers the `generate` and `train_step` MFCs (one model, policy version counted
per train step) and, for decoupled PPO, the `inference` MFC that recomputes the proximal
policy's log-probabilities (`proximal_logprobs`) with the weights the trainer holds before the
step, as AReaL does; `train_step` then takes its ratio against them. `EnvReward` answers
`rew_inf` with the environment's reward. Each datapoint is one sampled completion;
`packed_prompts` holds the prompt's token ids (see `rlplex.models.hf.encode_prompt`) and
`task_ids` the example and its group (the prompt it was sampled for), so advantages are
computed within groups present in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlplex.algos.grpo import grpo_loss
from rlplex.algos.rl_math import group_advantages
from rlplex.dataflow.mfc import MFCDef
from rlplex.models.hf import Tokenizer, decode_completion, stop_token_ids
from rlplex.models.lm import generate, left_pad, pad_id_of, token_logprobs
from rlplex.tasks import Environment, Example


@dataclass(frozen=True)
class TaskItem:
    example: Example
    group: int


class GRPOActor:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        max_new_tokens: int,
        lr: float = 1e-3,
        clip: float = 0.2,
        epochs: int = 2,
        max_grad_norm: float = 1.0,
        seed: int = 0,
        behav_imp_weight_cap: float | None = None,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.clip, self.epochs, self.max_grad_norm = clip, epochs, max_grad_norm
        self.behav_imp_weight_cap = behav_imp_weight_cap
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
        self.version = 0
        self.last_stats: dict[str, float] = {}

    def generate(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        rollouts = generate(
            self.model, self.tokenizer, inputs["packed_prompts"], self.max_new_tokens, generator=self.generator
        ).cpu()
        tokens, logprobs, masks = [], [], []
        for row in range(len(inputs["packed_prompts"])):
            keep = rollouts.attention_B_L[row].bool()
            tokens.append(rollouts.tokens_B_L[row][keep])
            logprobs.append(rollouts.logprobs_B_L[row][keep])
            masks.append(rollouts.completion_mask_B_L[row][keep])
        return {"packed_input_ids": tokens, "packed_logprobs": logprobs, "prompt_mask": masks}

    @torch.no_grad()
    def inference(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """The proximal policy's log-probabilities of each sequence (0 at position 0), by the
        current weights: what `train_step` anchors its ratio on in decoupled PPO."""
        sequences = inputs["packed_input_ids"]
        tokens, attention = left_pad([t.tolist() for t in sequences], pad_id_of(self.tokenizer))
        device = next(self.model.parameters()).device
        logprobs = token_logprobs(self.model, tokens.to(device), attention.to(device)).float().cpu()
        width = tokens.shape[1]
        return {"proximal_logprobs": [logprobs[row, width - len(s) :].clone() for row, s in enumerate(sequences)]}

    def train_step(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        # Group order, not arrival order: the update then does not depend on which rollout
        # worker finished first (a resumed run repeats the uninterrupted one exactly).
        order = sorted(range(len(inputs["task_ids"])), key=lambda i: inputs["task_ids"][i].group)
        inputs = {key: [values[i] for i in order] for key, values in inputs.items()}
        items: list[TaskItem] = inputs["task_ids"]
        rewards = torch.tensor(inputs["rewards"], dtype=torch.float32)
        advantages = group_advantages(rewards, torch.tensor([item.group for item in items]))
        tokens, attention = left_pad([t.tolist() for t in inputs["packed_input_ids"]], pad_id_of(self.tokenizer))
        width = tokens.shape[1]
        old = torch.zeros(tokens.shape)
        mask = torch.zeros(tokens.shape, dtype=torch.bool)
        for row, (logp, m) in enumerate(zip(inputs["packed_logprobs"], inputs["prompt_mask"], strict=True)):
            old[row, width - len(logp) :] = logp
            mask[row, width - len(m) :] = m
        proximal: torch.Tensor | None = None
        if "proximal_logprobs" in inputs:
            proximal = torch.zeros(tokens.shape)
            for row, logp in enumerate(inputs["proximal_logprobs"]):
                proximal[row, width - len(logp) :] = logp
        device = next(self.model.parameters()).device
        tokens, attention, old, mask, advantages = (t.to(device) for t in (tokens, attention, old, mask, advantages))
        proximal = proximal.to(device) if proximal is not None else None
        self.model.train()
        stats: dict[str, float] = {}
        for _ in range(self.epochs):
            loss, stats = grpo_loss(
                token_logprobs(self.model, tokens, attention),
                old,
                advantages,
                mask,
                self.clip,
                proximal_logprobs_B_L=proximal,
                behav_imp_weight_cap=self.behav_imp_weight_cap,
            )
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            self.optimizer.step()
        self.model.eval()
        self.version += 1
        self.last_stats = {**stats, "charts/reward_mean": float(rewards.mean()), "charts/policy_version": self.version}
        return {}


class EnvReward:
    """`rew_inf`: decodes each completion (the tokens after its prompt, up to a stop token) and
    scores it with the environment's reward."""

    def __init__(self, env: Environment, tokenizer: Tokenizer) -> None:
        self.env = env
        self.tokenizer = tokenizer
        self.stop_ids = stop_token_ids(tokenizer)

    def completion(self, ids: torch.Tensor, completion_mask: torch.Tensor) -> str:
        return decode_completion(self.tokenizer, ids[completion_mask].tolist(), self.stop_ids)

    def scores(self, ids: list[torch.Tensor], masks: list[torch.Tensor], items: list[TaskItem]) -> list[float]:
        completions = [self.completion(i, m) for i, m in zip(ids, masks, strict=True)]
        return self.env.score([item.example for item in items], completions)

    def inference(self, mfc: MFCDef, inputs: dict[str, list[Any]]) -> dict[str, list[Any]]:
        return {"rewards": self.scores(inputs["packed_input_ids"], inputs["prompt_mask"], inputs["task_ids"])}


def group_samples(
    reward_model: EnvReward,
    example: Example,
    group: int,
    ids: list[torch.Tensor],
    logprobs: list[torch.Tensor],
    masks: list[torch.Tensor],
) -> list[dict[str, Any]]:
    """One sampled group as the stream's samples: each row scored, tagged with its task and group."""
    items = [TaskItem(example, group)] * len(ids)
    rewards = reward_model.scores(ids, masks, items)
    return [
        {"packed_input_ids": i, "packed_logprobs": lp, "prompt_mask": m, "task_ids": item, "rewards": r}
        for i, lp, m, item, r in zip(ids, logprobs, masks, items, rewards, strict=True)
    ]
