from __future__ import annotations

import numpy as np
import pytest
import torch

from rlplex.algos.grpo import group_advantages, grpo_loss
from rlplex.errors import ConfigError, RlplexError
from rlplex.models.lm import TinyLMConfig, build_tiny_lm, generate, mean_reward, supervised_warmup, token_logprobs
from rlplex.tasks import CharTokenizer, Problem, get_task, task_names


def test_tokenizer_roundtrip_and_unknown_character() -> None:
    tok = CharTokenizer()
    ids = tok.encode("r:abc>")
    assert ids[0] == tok.bos_id and tok.decode(ids) == "r:abc>"
    assert tok.decode([*tok.encode("12", bos=False), tok.eos_id, *tok.encode("9", bos=False)]) == "12"
    with pytest.raises(RlplexError, match="'!'"):
        tok.encode("a!")


@pytest.mark.parametrize("name", task_names())
def test_tasks_score_exact_answers_one_and_garbage_low(name: str) -> None:
    task = get_task(name)
    for problem in task.sample(20, np.random.default_rng(0)):
        assert task.reward(problem, problem.answer) == 1.0
        assert task.reward(problem, "") == 0.0
        assert len(problem.answer) <= task.max_answer_len


def test_partial_credit_and_unknown_task() -> None:
    task = get_task("reverse")
    assert task.reward(Problem("r:abcd>", "dcba"), "dcbx") == 0.75
    assert task.reward(Problem("r:abcd>", "dcba"), "dcbaa") == 0.8  # too long costs a position
    with pytest.raises(ConfigError, match="unknown task 'nope'"):
        get_task("nope")


def test_generation_logprobs_match_rescoring() -> None:
    tok = CharTokenizer()
    model = build_tiny_lm(TinyLMConfig(), tok).eval()
    rollouts = generate(model, tok, ["r:abc>", "s:93142>", "1+2="], 6, 1.0, torch.Generator().manual_seed(0))
    rescored = token_logprobs(model, rollouts.tokens_B_L, rollouts.attention_B_L)
    mask = rollouts.completion_mask_B_L
    assert mask.any()
    assert torch.allclose(rescored[mask], rollouts.logprobs_B_L[mask], atol=1e-5)
    assert torch.all(rollouts.logprobs_B_L[~mask] == 0)


def test_rescoring_at_the_sampling_temperature_matches_and_at_one_does_not() -> None:
    tok = CharTokenizer()
    model = build_tiny_lm(TinyLMConfig(), tok).eval()
    rollouts = generate(model, tok, ["r:abc>", "r:hgfe>"], 6, 1.5, torch.Generator().manual_seed(0))
    mask = rollouts.completion_mask_B_L
    at_t = token_logprobs(model, rollouts.tokens_B_L, rollouts.attention_B_L, torch.tensor([1.5, 1.5]))
    at_one = token_logprobs(model, rollouts.tokens_B_L, rollouts.attention_B_L)
    assert torch.allclose(at_t[mask], rollouts.logprobs_B_L[mask], atol=1e-5)
    assert not torch.allclose(at_one[mask], rollouts.logprobs_B_L[mask], atol=1e-3)


def test_model_is_built_from_config_deterministically() -> None:
    a, b = build_tiny_lm(TinyLMConfig(seed=3)), build_tiny_lm(TinyLMConfig(seed=3))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_group_advantages_and_loss_direction() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), group_size=2)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-4)
    logprobs = torch.zeros(2, 3, requires_grad=True)
    loss, stats = grpo_loss(logprobs, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool))
    loss.backward()
    assert logprobs.grad is not None
    # Gradient descent raises log-probs of the advantaged sequence and lowers the other's.
    assert torch.all(logprobs.grad[0] < 0) and torch.all(logprobs.grad[1] > 0)
    assert stats["losses/clipfrac"] == 0.0


def test_warmup_then_grpo_raises_reward() -> None:
    """Learning smoke test: the warm-up gives a signal and a few GRPO steps improve on it."""
    torch.manual_seed(0)
    tok, task = CharTokenizer(), get_task("reverse")
    model = build_tiny_lm(TinyLMConfig(), tok)
    supervised_warmup(model, tok, task, steps=40, batch_size=64)
    before = mean_reward(model, tok, task, 256, seed=1)
    assert before > 0.1
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(5)
    group = 8
    for _ in range(30):
        problems = [p for p in task.sample(16, rng) for _ in range(group)]
        rollouts = generate(model, tok, [p.prompt for p in problems], task.max_answer_len + 1)
        rewards = torch.tensor([task.reward(p, c) for p, c in zip(problems, rollouts.completions, strict=True)])
        model.train()
        for _ in range(2):
            logprobs = token_logprobs(model, rollouts.tokens_B_L, rollouts.attention_B_L)
            loss, _ = grpo_loss(
                logprobs, rollouts.logprobs_B_L, group_advantages(rewards, group), rollouts.completion_mask_B_L
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
    assert mean_reward(model, tok, task, 256, seed=1) > before + 0.1
