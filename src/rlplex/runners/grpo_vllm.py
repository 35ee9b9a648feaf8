"""GRPO's rollouts on vLLM: the policy is a LoRA adapter of the frozen model, trained here and
served by a vLLM server this runner starts (`GRPOLMConfig.inference.engine = "vllm"`), or by
one that already runs: `inference.endpoint_dir` names its folder (`endpoint.json` and `api_key`,
as a main job's inference role writes them), and the runner starts no server of its own. That
server must serve the same base model with LoRA enabled, ranks up to `lora_rank`.

The trainer trains the adapter with the same `MultiLoRALinear` code the multi-run trainer uses
and, after each step, writes it as a PEFT folder (`adapters/v<version>`, a new folder per
version, STABLE last). Each rollout worker is a `VLLMClient` with its own adapter name on the
server; when it picks up a newer version it loads that folder under its name (`load_inplace`)
and samples the next groups from it. Completions come back as token ids with the sampling
policy's log-probabilities, which are the behaviour log-probabilities of the GRPO loss.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from rlplex.algos.lm_interfaces import EnvReward, group_samples
from rlplex.dataflow.stream import RolloutWorker, StalenessController, StreamDataset, WeightBroadcaster
from rlplex.inference.client import VLLMClient
from rlplex.inference.config import InferenceConfig
from rlplex.inference.engine import SamplingParams
from rlplex.inference.vllm_server import Endpoint, VLLMServer, free_port, require_vllm
from rlplex.models.hf import Tokenizer, encode_prompt, model_stop_ids
from rlplex.models.spec import ModelSpec
from rlplex.multirun.rundir.peft_export import write_peft_adapter
from rlplex.multirun.trainer.lora_apply import MultiLoRAModules, apply_multi_lora
from rlplex.tasks import Environment


class OneAdapter(nn.Module):
    """The model with every row routed through LoRA slot 0 (what `generate` and the loss call)."""

    def __init__(self, model: nn.Module, lora: MultiLoRAModules) -> None:
        super().__init__()
        self.model, self.lora = model, lora
        self.generation_config = getattr(model, "generation_config", None)

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        with self.lora.active_adapters(torch.zeros(input_ids.shape[0], dtype=torch.long)):
            return self.model(input_ids=input_ids, **kwargs)


class ServedLoRAPolicy:
    """The trained adapter, its exported versions, and the vLLM server that samples from them."""

    def __init__(self, spec: ModelSpec, model: nn.Module, inference: InferenceConfig, rank: int, work_dir: Path):
        require_vllm(spec)
        self.spec, self.inference, self.rank, self.alpha = spec, inference, rank, 2.0 * rank
        self.lora = apply_multi_lora(model, None, rank=rank, n_adapters=1, alpha=self.alpha, lora_dtype=torch.float32)
        self.base_config = getattr(model, "config", None)
        self.module = OneAdapter(model, self.lora)
        self.adapters = work_dir / "adapters"
        self.clients: list[VLLMClient] = []
        self.server: VLLMServer | None = None
        if inference.endpoint_dir is None:
            self.api_key = secrets.token_urlsafe(32)
            port = inference.port or free_port(inference.host)
            self.server = VLLMServer(spec, inference, self.api_key, port, work_dir / "vllm_server.log")

    def start(self) -> float:
        """Start the server; return the seconds until it answered /health. A server at
        `endpoint_dir` is not started here: each client waits for its endpoint on its first call
        (up to `reconnect_timeout_s`), as a main job's orchestrators do."""
        if self.server is None:
            return 0.0
        self.server.start()
        return self.server.wait_ready(self.inference.startup_timeout_s)

    def export(self, version: int) -> Path:
        state = {k: v.detach().cpu() for k, v in self.lora.adapter_state_dict(0).items()}
        return write_peft_adapter(
            self.adapters / f"v{version}",
            state,
            self.base_config,
            self.rank,
            self.alpha,
            self.lora.target_modules,
            fan_in_fan_out=self.lora.fan_in_fan_out,
        )

    def client(self) -> VLLMClient:
        if self.server is None:
            client = VLLMClient.for_settings(self.inference)
        else:
            client = VLLMClient(Endpoint((self.server.url,), 0), self.api_key, self.inference)
        self.clients.append(client)
        return client

    def close(self) -> None:
        for client in self.clients:
            client.close()
        if self.server is not None:
            self.server.stop()


def served_rollout_worker(
    index: int,
    seed: int,
    group_size: int,
    policy: ServedLoRAPolicy,
    tokenizer: Tokenizer,
    task: Environment,
    reward_model: EnvReward,
    controller: StalenessController,
    stream: StreamDataset,
    weights: WeightBroadcaster,
    version: int = 0,
) -> RolloutWorker:
    """A rollout worker that samples each group on the server with its own adapter name,
    starting from the exported adapter of policy `version` (not 0 after a resume)."""
    client, name = policy.client(), f"policy-w{index}"
    client.load_adapter(name, policy.adapters / f"v{version}")
    stops = tuple(model_stop_ids(policy.spec, tokenizer))

    def rollout(group: int) -> list[dict[str, Any]]:
        rng = np.random.default_rng((seed, group))
        example = task.sample(1, rng)[0]
        prompt = encode_prompt(tokenizer, example)
        params = SamplingParams(task.max_new_tokens, 1.0, stops, int(rng.integers(2**31)))
        completions = client.generate(name, [prompt] * group_size, params)
        ids = [torch.tensor([*prompt, *c.token_ids], dtype=torch.int64) for c in completions]
        masks = [torch.arange(len(i)) >= len(prompt) for i in ids]
        logprobs = [torch.tensor([0.0] * len(prompt) + c.logprobs, dtype=torch.float32) for c in completions]
        return group_samples(reward_model, example, group, ids, logprobs, masks)

    def load(state: dict[str, Any]) -> None:
        client.load_adapter(name, Path(state["adapter_dir"]))

    return RolloutWorker(f"rollout{index}", rollout, load, group_size, controller, stream, weights)
