"""Inference engines for rollouts: one protocol (`InferenceEngine`), a vLLM server process
(`VLLMServer`) and its OpenAI-API client (`VLLMClient`); the in-process engine is
`rlplex.multirun.orchestrator.hf_engine.HFEngine`.
"""

from rlplex.inference.config import EngineSettings, InferenceConfig
from rlplex.inference.engine import Completion, InferenceEngine, SamplingParams

__all__ = ["Completion", "EngineSettings", "InferenceConfig", "InferenceEngine", "SamplingParams"]
