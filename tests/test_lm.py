"""Language models the Hugging Face way: the tiny checkpoint, loading, tokenizers, generation,
scoring and the warm-up, on rlplex's tiny model and on an independently built random Llama."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lm_models import random_llama, tiny_model
from rlplex.algos.grpo import grpo_loss
from rlplex.algos.rl_math import group_advantages
from rlplex.errors import ConfigError, DeviceError, ModelLoadError
from rlplex.models.device import model_device, resolve_device
from rlplex.models.hf import (
    decode_completion,
    encode_prompt,
    load_causal_lm,
    load_tokenizer,
    stop_token_ids,
)
from rlplex.models.lm import evaluate, generate, mean_reward, token_logprobs
from rlplex.models.spec import ModelSpec
from rlplex.models.tiny import SETTINGS_FILE, TinyModelConfig, build_tiny_model
from rlplex.tasks import Example, load_environment

MODELS = {"tiny": tiny_model, "llama": random_llama}


@pytest.fixture(params=sorted(MODELS))
def spec(request: pytest.FixtureRequest) -> ModelSpec:
    return ModelSpec(name=str(MODELS[request.param]()), device="cpu")


def test_tokenizer_round_trips_text_special_tokens_and_chat(spec: ModelSpec) -> None:
    tokenizer = load_tokenizer(spec)
    text = "r:abc> 12+30= Tom has 3 apples."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    eos = tokenizer.eos_token_id
    assert eos is not None and tokenizer.pad_token_id is not None
    # A completion ends at its first stop token; what follows (and special tokens) is dropped.
    tail = tokenizer.encode("42", add_special_tokens=False)
    assert decode_completion(tokenizer, [*tail, eos, *tail], stop_token_ids(tokenizer)) == "42"
    chat = Example(messages=({"role": "user", "content": "What is 2+3?"},), answer="5")
    rendered = tokenizer.decode(encode_prompt(tokenizer, chat))
    assert "What is 2+3?" in rendered and rendered != "What is 2+3?"  # the template wrapped it
    assert encode_prompt(tokenizer, Example(prompt="r:abc>", answer="cba")) == tokenizer.encode("r:abc>")


def test_generation_logprobs_match_rescoring(spec: ModelSpec) -> None:
    model, tokenizer = load_causal_lm(spec), load_tokenizer(spec)
    prompts = [tokenizer.encode(p) for p in ("r:abc>", "s:93142>", "1+2=")]
    rollouts = generate(model, tokenizer, prompts, 6, 1.0, torch.Generator(model_device(model)).manual_seed(0))
    rescored = token_logprobs(model, rollouts.tokens_B_L, rollouts.attention_B_L)
    mask = rollouts.completion_mask_B_L
    assert mask.any()
    assert torch.allclose(rescored[mask], rollouts.logprobs_B_L[mask], atol=1e-5)
    assert torch.all(rollouts.logprobs_B_L[~mask] == 0)
    assert len(rollouts.completions) == 3


def test_rescoring_at_the_sampling_temperature_matches_and_at_one_does_not() -> None:
    spec = ModelSpec(name=str(tiny_model()))
    model, tokenizer = load_causal_lm(spec), load_tokenizer(spec)
    prompts = [tokenizer.encode(p) for p in ("r:abc>", "r:hgfe>")]
    rollouts = generate(model, tokenizer, prompts, 6, 1.5, torch.Generator(model_device(model)).manual_seed(0))
    mask = rollouts.completion_mask_B_L
    at_t = token_logprobs(model, rollouts.tokens_B_L, rollouts.attention_B_L, torch.tensor([1.5, 1.5]))
    at_one = token_logprobs(model, rollouts.tokens_B_L, rollouts.attention_B_L)
    assert torch.allclose(at_t[mask], rollouts.logprobs_B_L[mask], atol=1e-5)
    assert not torch.allclose(at_one[mask], rollouts.logprobs_B_L[mask], atol=1e-3)


def test_tiny_checkpoint_is_a_warmed_up_hugging_face_model() -> None:
    path = tiny_model()
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    # The warm-up gave the policy a signal on its task (an untrained model scores about 0.1).
    assert mean_reward(model, tokenizer, load_environment("reverse"), 128, seed=3) > 0.4


def test_evaluate_scores_fixed_examples_greedy_and_sampled() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model()
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    env = load_environment("reverse")
    examples = env.sample(48, np.random.default_rng(5))
    greedy = evaluate(model, tokenizer, env, examples, temperature=0.0, batch_size=16)
    assert greedy == evaluate(model, tokenizer, env, examples, temperature=0.0, batch_size=16)  # greedy is fixed
    assert greedy.n == 48 and 0.2 < greedy.accuracy <= greedy.reward <= 1.0  # positional: partial credit
    sampled = [evaluate(model, tokenizer, env, examples, temperature=1.0, seed=seed) for seed in (1, 2)]
    assert sampled[0] != sampled[1] and all(e.temperature == 1.0 for e in sampled)
    # An environment's own notion of right (`correct`) is the accuracy, whatever its reward adds.
    arithmetic = load_environment({"name": "arithmetic", "format_weight": 0.5})
    marked = evaluate(model, tokenizer, arithmetic, arithmetic.sample(4, np.random.default_rng(0)), max_new_tokens=2)
    assert marked.accuracy == 0.0 and marked.reward == 0.0


def test_tiny_build_is_cached_by_settings_and_refuses_other_settings(tmp_path: Path) -> None:
    config = TinyModelConfig(warmup_steps=2, warmup_batch_size=4)
    out = build_tiny_model(tmp_path / "m", config)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    started = time.perf_counter()
    assert build_tiny_model(tmp_path / "m", config) == out
    assert time.perf_counter() - started < 1.0
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    with pytest.raises(ConfigError, match="other settings"):
        build_tiny_model(tmp_path / "m", config.model_copy(update={"seed": 1}))
    assert (out / SETTINGS_FILE).is_file()


def _build(path: str, seed: int) -> None:
    build_tiny_model(path, TinyModelConfig(warmup_steps=3, warmup_batch_size=4, seed=seed))


@pytest.mark.slow
def test_two_processes_building_at_once_get_one_model(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_build, args=(str(tmp_path / "m"), 5)) for _ in range(2)]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(timeout=120)
            assert proc.exitcode == 0
    finally:
        for proc in procs:
            proc.kill()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["m"]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # no half-built folder left
    load_causal_lm(ModelSpec(name=str(tmp_path / "m")))


def test_a_hub_id_not_in_the_cache_is_a_clear_error_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelLoadError, match=r"'nobody-here/no-such-model'.*not in the Hugging Face cache") as info:
        load_tokenizer(ModelSpec(name="nobody-here/no-such-model"))
    message = str(info.value)
    assert "\n" not in message and "HF_HUB_OFFLINE is set" in message and "save_pretrained folder" in message
    assert "internet connection" not in message  # transformers' advice, wrong when offline on purpose


def test_an_unreachable_hub_is_one_line_at_once_without_retries(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Issue 32, hole 4: a hub id that is not cached, with no hub to reach, fails on a
    connection check instead of a minute of download retries."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(ModelLoadError) as info:
        load_tokenizer(ModelSpec(name="nobody-here/no-such-model"))
    message = str(info.value)
    assert "\n" not in message and "'nobody-here/no-such-model'" in message
    assert "the hub cannot be reached (127.0.0.1:9:" in message and "save_pretrained folder" in message
    assert "Retrying" not in capfd.readouterr().err


def test_a_folder_that_does_not_exist_is_named_as_such(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no such folder.*rlplex model tiny"):
        load_tokenizer(ModelSpec(name=str(tmp_path / "missing" / "model")))


def test_specs_name_the_same_local_model_whatever_the_spelling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    assert ModelSpec(name="m").identity() == ModelSpec(name=str(tmp_path / "m") + "/").identity()
    assert ModelSpec(name="org/x").identity() != ModelSpec(name="org/x", revision="v2").identity()
    assert ModelSpec(name="m").resolved().name == str(tmp_path / "m")


def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    assert resolve_device("cpu").type == "cpu"
    if torch.cuda.is_available():
        assert resolve_device("cuda").type == "cuda" and resolve_device("auto").type == "cuda"
        return
    assert resolve_device("auto").type == "cpu"
    with pytest.raises(DeviceError, match=r"'cuda' was asked for.*no CUDA device"):
        resolve_device("cuda")
    with pytest.raises(DeviceError):
        load_causal_lm(ModelSpec(name=str(tiny_model()), device="cuda"))


def test_group_advantages_and_loss_direction() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), 2)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]), atol=1e-4)
    logprobs = torch.zeros(2, 3, requires_grad=True)
    loss, stats = grpo_loss(logprobs, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool))
    loss.backward()
    assert logprobs.grad is not None
    # Gradient descent raises log-probs of the advantaged sequence and lowers the other's.
    assert torch.all(logprobs.grad[0] < 0) and torch.all(logprobs.grad[1] > 0)
    assert stats["losses/clipfrac"] == 0.0


@pytest.mark.slow
def test_warmed_up_checkpoint_then_grpo_raises_reward() -> None:
    """Learning smoke test: a short warm-up gives a signal and a few GRPO steps improve on it."""
    torch.manual_seed(0)
    spec = ModelSpec(name=str(tiny_model(warmup_steps=40)))
    model, tok, env = load_causal_lm(spec).requires_grad_(True), load_tokenizer(spec), load_environment("reverse")
    before = mean_reward(model, tok, env, 256, seed=1)
    assert before > 0.1
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(5)
    group = 8
    for _ in range(30):
        examples = [e for e in env.sample(16, rng) for _ in range(group)]
        rollouts = generate(model, tok, [encode_prompt(tok, e) for e in examples], env.max_new_tokens)
        rewards = torch.tensor(env.score(examples, rollouts.completions), device=model_device(model))
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
    assert mean_reward(model, tok, env, 256, seed=1) > before + 0.1
