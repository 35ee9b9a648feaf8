"""The one protocol every inference engine speaks: adapters in, token ids and log-probabilities out.

An orchestrator holds an `InferenceEngine` and never knows which one: `VLLMClient` (requests to
the job's vLLM servers) or `HFEngine` (transformers generation in the orchestrator's process).
Prompts go in as token ids and completions come back as token ids, so nothing is re-tokenised
between the sampler and the trainer; each token's log-probability is the sampling policy's
(temperature applied), which becomes the behaviour log-probability of the PPO/GRPO loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float  # 0 = greedy
    stop_ids: tuple[int, ...]
    seed: int  # prompt i of a call is sampled with seed + i (per request on a server)
    ignore_eos: bool = False  # generate all max_tokens (benchmarks: the same work on every engine)


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]  # generated tokens, the stop token included when one ended it
    logprobs: list[float]  # one per token: log p(token) under the sampling distribution
    finish_reason: str  # "stop" or "length"

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} tokens but {len(self.logprobs)} log-probabilities")


class InferenceEngine(Protocol):
    """Serves adapters by name. Loading a name that is loaded replaces it (a new version)."""

    def load_adapter(self, name: str, path: Path) -> float:
        """Load (or replace) adapter `name` from a PEFT folder; return the seconds the load took."""
        ...

    def unload_adapter(self, name: str) -> None: ...

    def generate(self, adapter: str, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """One completion per prompt, sampled from the base model plus adapter `adapter`."""
        ...

    def close(self) -> None: ...
