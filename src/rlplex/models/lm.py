"""What RL does with a causal language model: sample completions, score token
log-probabilities, and a short supervised warm-up (used to build the tiny checkpoint).

Any Hugging Face causal LM and tokenizer work here: prompts arrive as token ids (rendered by
`rlplex.models.hf.encode_prompt`, chat template included), padding uses the tokenizer's pad
id, and a completion ends at any of the model's stop ids. Prompts are left-padded so that
every completion starts at the same column; position ids are derived from the attention
mask, the same way in generation and in scoring, so the log-probabilities of a rollout and of
its re-scoring agree. Tensors are made on the model's device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rlplex.models.device import model_device
from rlplex.models.hf import Tokenizer, decode_completion, encode_answer, encode_prompt, stop_token_ids
from rlplex.models.logprobs import positions_of, token_logprobs
from rlplex.tasks import Environment, Example
from rlplex.tasks.evaluation import Evaluation, score_evaluation


@dataclass
class Rollouts:
    """A batch of prompts with sampled completions, as one left-padded token matrix."""

    tokens_B_L: torch.Tensor  # int64, prompt (left-padded) then completion (right-padded)
    attention_B_L: torch.Tensor  # int64, 1 on real tokens
    completion_mask_B_L: torch.Tensor  # bool, True on generated tokens (up to and including EOS)
    logprobs_B_L: torch.Tensor  # float32, log-prob of each generated token under the sampling policy, 0 elsewhere
    completions: list[str]

    def cpu(self) -> Rollouts:
        return Rollouts(
            self.tokens_B_L.cpu(),
            self.attention_B_L.cpu(),
            self.completion_mask_B_L.cpu(),
            self.logprobs_B_L.cpu(),
            self.completions,
        )


def _last_logits_only(model: torch.nn.Module) -> dict[str, int]:
    """`logits_to_keep=1` where the model takes it: sampling reads the last position's logits only,
    and the prompt's other positions would cost a [rows, prompt, vocab] projection (a fifth of
    SmolLM2-135M's prefill, whose vocabulary is 49,152)."""
    import inspect

    forward = inspect.signature(model.forward).parameters
    return {"logits_to_keep": 1} if "logits_to_keep" in forward else {}


def left_pad(batch: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids in batch)
    tokens = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(batch), width), dtype=torch.long)
    for i, ids in enumerate(batch):
        tokens[i, width - len(ids) :] = torch.tensor(list(ids), dtype=torch.long)
        attention[i, width - len(ids) :] = 1
    return tokens, attention


def pad_id_of(tokenizer: Tokenizer) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return int(pad)


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    stop_ids: Sequence[int] | None = None,
) -> Rollouts:
    """Sample one completion per prompt (token ids) with a KV cache; greedy when temperature is 0.

    `generator` must live on the model's device (a CPU generator for a CPU model).
    """
    device = model_device(model)
    stops = list(stop_ids) if stop_ids is not None else stop_token_ids(tokenizer, model)
    pad_id = pad_id_of(tokenizer)
    tokens, attention = (t.to(device) for t in left_pad(prompts, pad_id))
    stop_B = torch.tensor(stops, device=device)
    n = len(prompts)
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    new_tokens, new_logprobs, new_mask = [], [], []
    past = None
    step_input, step_attention = tokens, attention
    last_only = _last_logits_only(model)
    for _ in range(max_new_tokens):
        out = model(
            input_ids=step_input,
            attention_mask=step_attention,
            position_ids=positions_of(step_attention)[:, -step_input.shape[1] :],
            past_key_values=past,
            use_cache=True,
            **last_only,
        )
        past = out.past_key_values
        logits = out.logits[:, -1, :].float()
        log_p = torch.log_softmax(logits / max(temperature, 1e-6), dim=-1)
        if temperature == 0:
            choice = log_p.argmax(-1)
        else:
            choice = torch.multinomial(log_p.exp(), 1, generator=generator).squeeze(-1)
        choice = torch.where(finished, torch.full_like(choice, pad_id), choice)
        new_mask.append(~finished)
        new_logprobs.append(torch.where(finished, 0.0, log_p.gather(-1, choice[:, None]).squeeze(-1)))
        new_tokens.append(choice)
        finished = finished | torch.isin(choice, stop_B)
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
    completions = [decode_completion(tokenizer, row, stops) for row in gen.tolist()]
    return Rollouts(full_tokens, full_attention, completion_mask, logprobs, completions)


def supervised_warmup(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    environments: Sequence[Environment],
    steps: int,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Teacher-forced training on correct answers (each followed by the EOS token), the
    environments taken in turn batch by batch; returns the loss per step."""
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    eos = stop_token_ids(tokenizer, model)[0] if tokenizer.eos_token_id is None else int(tokenizer.eos_token_id)
    device = model_device(model)
    losses = []
    model.train()
    for step in range(steps):
        examples = environments[step % len(environments)].sample(batch_size, rng)
        prompts = [encode_prompt(tokenizer, e) for e in examples]
        answers = [[*encode_answer(tokenizer, e.answer), eos] for e in examples]
        tokens, attention = left_pad([p + a for p, a in zip(prompts, answers, strict=True)], pad_id_of(tokenizer))
        answer_mask = torch.zeros_like(tokens, dtype=torch.bool)
        for i, answer in enumerate(answers):
            answer_mask[i, tokens.shape[1] - len(answer) :] = True
        tokens, attention, answer_mask = tokens.to(device), attention.to(device), answer_mask.to(device)
        loss = -(token_logprobs(model, tokens, attention) * answer_mask).sum() / answer_mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.item()))
        if on_step is not None:
            on_step(step + 1, losses[-1])
    model.eval()
    return losses


def _complete(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    examples: Sequence[Example],
    max_new_tokens: int,
    temperature: float,
    seed: int,
    batch_size: int,
) -> list[str]:
    """One completion per example, `batch_size` prompts per `generate` call, one seeded generator."""
    generator = torch.Generator(device=model_device(model)).manual_seed(seed)
    completions: list[str] = []
    for start in range(0, len(examples), batch_size):
        prompts = [encode_prompt(tokenizer, e) for e in examples[start : start + batch_size]]
        completions += generate(model, tokenizer, prompts, max_new_tokens, temperature, generator).completions
    return completions


def evaluate(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    environment: Environment,
    examples: Sequence[Example],
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 64,
    max_new_tokens: int | None = None,
) -> Evaluation:
    """Generate one completion per example (greedy at temperature 0) and score it: a held-out
    evaluation when `examples` come from the environment's held-out split."""
    tokens = max_new_tokens or environment.max_new_tokens
    completions = _complete(model, tokenizer, examples, tokens, temperature, seed, batch_size)
    return score_evaluation(environment, examples, completions, temperature)


def mean_reward(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    environment: Environment,
    n: int,
    seed: int,
    temperature: float = 1.0,
) -> float:
    """The mean reward of `n` fresh examples drawn with `seed`, sampled at `temperature` in one batch."""
    examples = environment.sample(n, np.random.default_rng(seed))
    completions = _complete(model, tokenizer, examples, environment.max_new_tokens, temperature, seed, max(n, 1))
    return float(np.mean(environment.score(examples, completions)))
