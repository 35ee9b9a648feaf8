"""`HFEngine`: the in-process `InferenceEngine` (engine = "hf"): transformers generation with the
base model plus one broadcast adapter in a MultiLoRA slot, the code the trainer trains with.

For machines where vLLM cannot be installed, and for the rollout worker processes. It serves
one adapter at a time (an orchestrator serves one run); loading a name replaces the adapter.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from rlplex.errors import InferenceError
from rlplex.inference.engine import Completion, SamplingParams
from rlplex.models.hf import Tokenizer
from rlplex.models.lm import generate
from rlplex.multirun.orchestrator.policy import AdapterPolicy


class HFEngine:
    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, max_rank: int) -> None:
        self.policy = AdapterPolicy(model, max_rank=max_rank)
        self.tokenizer = tokenizer
        self.adapter: str | None = None

    def load_adapter(self, name: str, path: Path) -> float:
        started = time.perf_counter()
        # The caller checked the folder (`check_stable_adapter`); reading within its parent refuses
        # it again if it was swapped for a link out of `broadcast/` since.
        self.policy.load(path, step=0, within=Path(path).parent)
        self.adapter = name
        return time.perf_counter() - started

    def unload_adapter(self, name: str) -> None:
        if self.adapter == name:
            self.adapter = None

    def generate(self, adapter: str, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        if adapter != self.adapter:
            raise InferenceError(f"adapter {adapter!r} is not loaded (this engine holds {self.adapter!r})")
        device = next(self.policy.model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(params.seed)
        stops = [] if params.ignore_eos else list(params.stop_ids)
        with self.policy.active(len(prompts)) as model:
            out = generate(
                model, self.tokenizer, prompts, params.max_tokens, params.temperature, generator, stops
            ).cpu()
        # One masked select and a split per tensor, not one indexing op per row and tensor.
        mask = out.completion_mask_B_L
        lengths = mask.sum(dim=1).tolist()
        tokens = out.tokens_B_L[mask].split(lengths)
        logprobs = out.logprobs_B_L.float()[mask].split(lengths)
        return [
            Completion(ids.tolist(), lp.tolist(), "stop" if len(ids) and int(ids[-1]) in stops else "length")
            for ids, lp in zip(tokens, logprobs, strict=True)
        ]

    def close(self) -> None:
        self.adapter = None
