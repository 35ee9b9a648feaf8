"""GRPO on the tiny language model, run as a dataflow of MFCs (learning smoke test)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from rlplex.algos.lm_interfaces import GRPOActor, TaskItem, TaskReward
from rlplex.dataflow import FunctionExecutor, LocalModelWorker, grpo_graph
from rlplex.models.lm import TinyLMConfig, build_tiny_lm, mean_reward, supervised_warmup
from rlplex.tasks import CharTokenizer, get_task


def grouped_prompts(task_name: str, group: int, seed: int) -> Iterator[dict[str, Any]]:
    task, rng = get_task(task_name), np.random.default_rng(seed)
    for group_id in itertools.count():
        problem = task.sample(1, rng)[0]
        for _ in range(group):
            yield {"packed_prompts": problem.prompt, "task_ids": TaskItem(problem, group_id)}


def test_grpo_through_the_executor_raises_reward() -> None:
    torch.manual_seed(0)
    tokenizer, task = CharTokenizer(), get_task("reverse")
    model = build_tiny_lm(TinyLMConfig(), tokenizer)
    supervised_warmup(model, tokenizer, task, steps=40)
    before = mean_reward(model, tokenizer, task, 256, seed=1)
    actor = GRPOActor(model, tokenizer, task.max_answer_len + 1, lr=1e-3)
    workers = {
        "actor": [LocalModelWorker("actor0", actor)],
        "reward": [LocalModelWorker("reward0", TaskReward(task, tokenizer))],
    }
    executor = FunctionExecutor(grpo_graph(batch_size=128), workers, grouped_prompts("reverse", 8, 5), capacity=256)

    async def train() -> None:
        for _ in range(30):
            await executor.execute_step()

    asyncio.run(asyncio.wait_for(train(), timeout=240))
    after = mean_reward(model, tokenizer, task, 256, seed=1)
    assert actor.version == 30
    assert after > before + 0.1, (before, after)
    assert executor.plane.n_values == 0
