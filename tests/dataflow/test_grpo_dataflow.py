"""GRPO on the tiny language model, run as a dataflow of MFCs (learning smoke test)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from lm_models import random_llama, tiny_model
from rlplex.algos.lm_interfaces import EnvReward, GRPOActor, TaskItem
from rlplex.dataflow import FunctionExecutor, LocalModelWorker, grpo_graph
from rlplex.models.hf import Tokenizer, encode_prompt, load_causal_lm, load_tokenizer
from rlplex.models.lm import mean_reward
from rlplex.models.spec import ModelSpec
from rlplex.runners.grpo_lm import GRPOLMConfig, train_grpo_lm
from rlplex.tasks import Environment, load_environment


def grouped_prompts(env: Environment, tokenizer: Tokenizer, group: int, seed: int) -> Iterator[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    for group_id in itertools.count():
        example = env.sample(1, rng)[0]
        for _ in range(group):
            yield {"packed_prompts": encode_prompt(tokenizer, example), "task_ids": TaskItem(example, group_id)}


@pytest.mark.slow
def test_grpo_through_the_executor_raises_reward() -> None:
    torch.manual_seed(0)
    spec = ModelSpec(name=str(tiny_model(warmup_steps=40)))
    tokenizer, task = load_tokenizer(spec), load_environment("reverse")
    model = load_causal_lm(spec).requires_grad_(True)
    before = mean_reward(model, tokenizer, task, 256, seed=1)
    actor = GRPOActor(model, tokenizer, task.max_new_tokens, lr=1e-3)
    workers = {
        "actor": [LocalModelWorker("actor0", actor)],
        "reward": [LocalModelWorker("reward0", EnvReward(task, tokenizer))],
    }
    prompts = grouped_prompts(task, tokenizer, 8, 5)
    executor = FunctionExecutor(grpo_graph(batch_size=128), workers, prompts, capacity=256)

    async def train() -> None:
        for _ in range(30):
            await executor.execute_step()

    asyncio.run(asyncio.wait_for(train(), timeout=240))
    after = mean_reward(model, tokenizer, task, 256, seed=1)
    assert actor.version == 30
    assert after > before + 0.1, (before, after)
    assert executor.plane.n_values == 0


def test_async_grpo_runs_on_an_independent_llama_with_a_chat_environment() -> None:
    """The dataflow's GRPO path on another architecture, tokenizer and prompt form (chat)."""
    config = GRPOLMConfig(
        model=ModelSpec(name=str(random_llama())),
        env={"name": "arithmetic", "max_new_tokens": 4},
        eta=1,
        steps=2,
        batch_size=8,
        group_size=4,
        eval_every=2,
        eval_samples=8,
    )
    result = train_grpo_lm(config)
    assert result.steps == 2 and result.max_staleness <= 1
    assert 0.0 <= result.final_reward <= 1.0
