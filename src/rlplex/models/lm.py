"""A tiny causal language model built from a config (random weights, no downloads), and
the three things RL does with it: sample completions, score token log-probabilities, and a
short supervised warm-up so that RL starts from a policy with some signal.

Prompts are left-padded so that every completion starts at the same column; position ids
are derived from the attention mask, the same way in generation and in scoring, so the
log-probabilities of a rollout and of its re-scoring agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from pydantic import Field
from transformers import LlamaConfig, LlamaForCausalLM

from rlplex.config import StrictModel
from rlplex.tasks import CharTokenizer, Task


class TinyLMConfig(StrictModel):
    hidden_size: int = Field(64, ge=8)
    intermediate_size: int = Field(192, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    max_len: int = Field(32, ge=8)
    seed: int = 0


def build_tiny_lm(config: TinyLMConfig | None = None, tokenizer: CharTokenizer | None = None) -> LlamaForCausalLM:
    config = config or TinyLMConfig()
    tokenizer = tokenizer or CharTokenizer()
    torch.manual_seed(config.seed)
    llama = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        max_position_embeddings=config.max_len,
        pad_token_id=tokenizer.pad_id,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(llama)


@dataclass
class Rollouts:
    """A batch of prompts with sampled completions, as one left-padded token matrix."""

    tokens_B_L: torch.Tensor  # int64, prompt (left-padded) then completion (right-padded)
    attention_B_L: torch.Tensor  # int64, 1 on real tokens
    completion_mask_B_L: torch.Tensor  # bool, True on generated tokens (up to and including EOS)
    logprobs_B_L: torch.Tensor  # float32, log-prob of each generated token under the sampling policy, 0 elsewhere
    completions: list[str]


def _positions(attention_B_L: torch.Tensor) -> torch.Tensor:
    return (attention_B_L.cumsum(-1) - 1).clamp(min=0)


def left_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids in batch)
    tokens = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for i, ids in enumerate(batch):
        tokens[i, width - len(ids) :] = torch.tensor(ids)
        attention[i, width - len(ids) :] = 1
    return tokens, attention


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    tokenizer: CharTokenizer,
    prompts: list[str],
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> Rollouts:
    """Sample one completion per prompt with a KV cache; greedy when temperature is 0."""
    tokens, attention = left_pad([tokenizer.encode(p) for p in prompts], tokenizer.pad_id)
    n = len(prompts)
    finished = torch.zeros(n, dtype=torch.bool)
    new_tokens, new_logprobs, new_mask = [], [], []
    past = None
    step_input, step_attention = tokens, attention
    for _ in range(max_new_tokens):
        out = model(
            input_ids=step_input,
            attention_mask=step_attention,
            position_ids=_positions(step_attention)[:, -step_input.shape[1] :],
            past_key_values=past,
            use_cache=True,
        )
        past = out.past_key_values
        logits = out.logits[:, -1, :].float()
        log_p = torch.log_softmax(logits / max(temperature, 1e-6), dim=-1)
        if temperature == 0:
            choice = log_p.argmax(-1)
        else:
            choice = torch.multinomial(log_p.exp(), 1, generator=generator).squeeze(-1)
        choice = torch.where(finished, torch.full_like(choice, tokenizer.pad_id), choice)
        new_mask.append(~finished)
        new_logprobs.append(torch.where(finished, 0.0, log_p.gather(-1, choice[:, None]).squeeze(-1)))
        new_tokens.append(choice)
        finished = finished | (choice == tokenizer.eos_id)
        step_input = choice[:, None]
        step_attention = torch.cat([step_attention, new_mask[-1][:, None].long()], dim=1)
        if bool(finished.all()):
            break
    gen = torch.stack(new_tokens, dim=1)
    mask = torch.stack(new_mask, dim=1)
    full_tokens = torch.cat([tokens, gen], dim=1)
    full_attention = torch.cat([attention, mask.long()], dim=1)
    completion_mask = torch.cat([torch.zeros_like(tokens, dtype=torch.bool), mask], dim=1)
    logprobs = torch.cat([torch.zeros_like(tokens, dtype=torch.float32), torch.stack(new_logprobs, dim=1)], dim=1)
    completions = [tokenizer.decode(row.tolist()) for row in gen]
    return Rollouts(full_tokens, full_attention, completion_mask, logprobs, completions)


def token_logprobs(
    model: torch.nn.Module,
    tokens_B_L: torch.Tensor,
    attention_B_L: torch.Tensor,
    temperature_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """log p(token_t | tokens_<t) for every position t >= 1 (position 0 gets 0); differentiable.

    `temperature_B`: each row's sampling temperature, scaling the logits exactly as `generate`
    does, so that importance ratios compare the same distribution that sampled the tokens.
    """
    logits = model(
        input_ids=tokens_B_L, attention_mask=attention_B_L, position_ids=_positions(attention_B_L)
    ).logits.float()
    if temperature_B is not None:
        logits = logits / temperature_B.to(logits.dtype).clamp_min(1e-6)[:, None, None]
    log_p = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens_B_L[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(log_p[:, :1]), log_p], dim=1)


def supervised_warmup(
    model: torch.nn.Module,
    tokenizer: CharTokenizer,
    task: Task,
    steps: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    """Teacher-forced training on correct answers; returns the loss per step."""
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    model.train()
    for _ in range(steps):
        problems = task.sample(batch_size, rng)
        sequences = [
            tokenizer.encode(p.prompt) + tokenizer.encode(p.answer, bos=False) + [tokenizer.eos_id] for p in problems
        ]
        tokens, attention = left_pad(sequences, tokenizer.pad_id)
        answer_mask = torch.zeros_like(tokens, dtype=torch.bool)
        for i, p in enumerate(problems):
            answer_mask[i, tokens.shape[1] - len(p.answer) - 1 :] = True
        loss = -(token_logprobs(model, tokens, attention) * answer_mask).sum() / answer_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.item()))
    model.eval()
    return losses


def mean_reward(
    model: torch.nn.Module, tokenizer: CharTokenizer, task: Task, n: int, seed: int, temperature: float = 1.0
) -> float:
    problems = task.sample(n, np.random.default_rng(seed))
    generator = torch.Generator().manual_seed(seed)
    rollouts = generate(model, tokenizer, [p.prompt for p in problems], task.max_answer_len + 1, temperature, generator)
    return float(np.mean([task.reward(p, c) for p, c in zip(problems, rollouts.completions, strict=True)]))
