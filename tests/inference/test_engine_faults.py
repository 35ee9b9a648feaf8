"""Faults around the inference engine: a server that errors or hangs, adapters the server
refuses (the run is evicted with the reason; another run on the same server carries on), and
the settings that must fail at load time rather than mid-run."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from vllm_helpers import Served, make_adapter

from rlplex.errors import ConfigError, InferenceUnavailableError, RunConfigError
from rlplex.inference.client import VLLMClient
from rlplex.inference.config import EngineSettings, InferenceConfig
from rlplex.inference.engine import SamplingParams
from rlplex.inference.vllm_server import (
    API_KEY_FILE,
    RESERVED_CPUS_ENV,
    THREADS_BIND_ENV,
    Endpoint,
    VLLMServer,
    check_model_for_vllm,
    cpu_threading_env,
    ensure_api_key,
    write_endpoint,
)
from rlplex.models.spec import ModelSpec
from rlplex.multirun.orchestrator.config import OrchestratorConfig, parse_orch_config
from rlplex.multirun.orchestrator.loop import RunEvictedError, WaitOptions, run_orchestrator
from rlplex.multirun.rundir import RunDir
from rlplex.multirun.rundir.peft_export import STABLE_MARKER
from rlplex.multirun.rundir.rollouts import rollouts_ready
from rlplex.multirun.trainer.log import ProgressLog


@contextmanager
def misbehaving_server(mode: str) -> Iterator[tuple[str, list[str]]]:
    """A local HTTP server that loads adapters but answers completions with HTTP 500 or never."""
    seen: list[str] = []
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            seen.append(self.path)
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path.endswith("load_lora_adapter"):
                self._answer(200, b"ok")
            elif mode == "error":
                self._answer(500, json.dumps({"error": {"message": "engine died"}}).encode())
            else:
                release.wait(30)  # hang until the test ends

        def _answer(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        release.set()
        server.shutdown()
        server.server_close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["error", "hang"])
def test_a_server_that_errors_or_hangs_ends_in_a_clear_failure_after_bounded_retries(mode: str, tmp_path: Path) -> None:
    with misbehaving_server(mode) as (url, seen):
        settings = EngineSettings(engine="vllm", request_timeout_s=0.5, max_retries=1, reconnect_timeout_s=2.0)
        client = VLLMClient(Endpoint((url,), 0), "key", settings)
        try:
            client.load_adapter("run_x", tmp_path)
            started = time.monotonic()
            with pytest.raises(InferenceUnavailableError, match="no inference server answered") as error:
                client.generate("run_x", [[1, 2, 3]], SamplingParams(4, 1.0, (), 0))
            elapsed = time.monotonic() - started
        finally:
            client.close()
    assert url in str(error.value)
    assert elapsed < 30, elapsed  # bounded: the reconnect deadline plus the retries' backoff
    completions = [path for path in seen if path.endswith("/completions")]
    assert 2 <= len(completions) <= 20, completions  # retried, but not forever


def test_groups_of_equal_prompts_travel_as_one_prompt_with_n_samples() -> None:
    from rlplex.inference.client import _requests_of

    prompts = [[1, 2]] * 4 + [[3]] * 4 + [[4]] * 4 + [[5]] * 2
    requests = _requests_of(prompts, per_request=2)
    assert requests == [(0, [[1, 2], [3]], 4), (8, [[4]], 4), (12, [[5]], 2)]
    rows = [row for first, chunk, n in requests for row in range(first, first + len(chunk) * n)]
    assert rows == list(range(len(prompts)))  # answers concatenate back in row order


def _stable_adapter(model: Path, folder: Path, seed: int) -> Path:
    make_adapter(model, folder, seed=seed, zero=True)  # the trainer's first broadcast: B = 0
    (folder / STABLE_MARKER).write_text("")
    return folder


def _run_config(served: Served, endpoint_dir: Path, seed: int) -> OrchestratorConfig:
    data = {
        "env": {"name": "reverse"},
        "seed": seed,
        "max_steps": 1,
        "batch_size": 8,
        "group_size": 4,
        "model": {"name": str(served.model_dir), "lora": {"rank": 4, "alpha": 8.0}},
        "inference": {"engine": "vllm", "endpoint_dir": str(endpoint_dir), "adapter_load_retries": 1},
    }
    return parse_orch_config(data, "test")


def test_a_refused_adapter_evicts_its_run_and_another_run_carries_on(served: Served, tmp_path: Path) -> None:
    endpoint_dir = tmp_path / "inference"
    endpoint_dir.mkdir()
    (endpoint_dir / API_KEY_FILE).write_text(served.api_key)
    write_endpoint(endpoint_dir, served.endpoint)
    runs = tmp_path / "runs"
    bad, good = RunDir(runs, "run_bad"), RunDir(runs, "run_good")
    corrupt = _stable_adapter(served.model_dir, bad.broadcast_step(0), seed=1)
    (corrupt / "adapter_model.safetensors").write_bytes(b"not safetensors at all")
    _stable_adapter(served.model_dir, good.broadcast_step(0), seed=2)
    wait = WaitOptions(timeout_s=60.0)
    with pytest.raises(RunEvictedError, match="refused adapter"):
        run_orchestrator(runs, "run_bad", _run_config(served, endpoint_dir, 1), wait, tensorboard=False)
    reason = bad.eviction_reason() or ""
    assert "refused adapter" in reason and "2 tries" in reason and str(corrupt) in reason

    stop = threading.Event()

    def trainer_answer() -> None:  # stands for the trainer: broadcast step 1 once rollouts 0 are in
        while not stop.is_set() and not rollouts_ready(good, 0):
            stop.wait(0.05)
        if not stop.is_set():
            _stable_adapter(served.model_dir, good.broadcast_step(1), seed=2)
            # and its row, which a finished orchestrator otherwise waits FINAL_ROW_WAIT_S for
            ProgressLog().append(good, {"step": 1, "time": time.time(), "loss": 0.0})

    answer = threading.Thread(target=trainer_answer, daemon=True)
    answer.start()
    try:
        assert run_orchestrator(runs, "run_good", _run_config(served, endpoint_dir, 2), wait, tensorboard=False) == 1
    finally:
        stop.set()
        answer.join(10)
    assert rollouts_ready(good, 0) and not good.is_evicted()


def test_settings_that_cannot_work_fail_when_loaded(tmp_path: Path) -> None:
    base = {"env": {"name": "reverse"}, "max_steps": 1, "batch_size": 8, "model": {"name": "m"}}
    with pytest.raises(RunConfigError, match="endpoint_dir"):
        parse_orch_config(base | {"inference": {"engine": "vllm"}}, "orch.toml")
    with pytest.raises(RunConfigError, match="rollout_workers"):
        parse_orch_config(
            base | {"rollout_workers": 2, "inference": {"engine": "vllm", "endpoint_dir": "/x"}}, "orch.toml"
        )
    with pytest.raises(RunConfigError, match=r"inference\.engine"):
        parse_orch_config(base | {"inference": {"engine": "sglang"}}, "orch.toml")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(ConfigError, match=r"config.json: head size 16"):
        check_model_for_vllm(ModelSpec(name=str(model)), "cpu")
    check_model_for_vllm(ModelSpec(name=str(model)), "gpu")  # CUDA kernels take other sizes


def test_the_server_gets_the_key_in_its_environment_never_on_its_command_line(tmp_path: Path) -> None:
    key = ensure_api_key(tmp_path / "inference")
    assert ensure_api_key(tmp_path / "inference") == key  # made once
    assert (tmp_path / "inference" / API_KEY_FILE).stat().st_mode & 0o077 == 0  # owner only
    config = InferenceConfig(engine="vllm", max_loras=3, extra_args=["--enforce-eager"])
    server = VLLMServer(ModelSpec(name=str(tmp_path)), config, key, 8123, tmp_path / "log")
    command = server.command()
    assert key not in " ".join(command) and server.environment()["VLLM_API_KEY"] == key
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--max-loras") + 1] == "3" and command[-1] == "--enforce-eager"
    assert command[command.index("--dtype") + 1] == "float32"  # "auto" on the CPU build: what the trainer uses
    # The CPU worker runs inside the engine core (one process fewer to start), unless the job asks otherwise.
    assert command[command.index("--distributed-executor-backend") + 1] == "uni"
    assert server.environment()["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    told = VLLMServer(ModelSpec(name="m"), InferenceConfig(engine="vllm", extra_args=["-tp", "2"]), key, 1, tmp_path)
    assert "--distributed-executor-backend" not in told.command()
    unset = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    assert told.environment().get("VLLM_ENABLE_V1_MULTIPROCESSING") == unset  # its workers: vLLM's choice
    gpu = VLLMServer(ModelSpec(name="m"), config, key, 1, tmp_path, build="gpu")
    assert "--distributed-executor-backend" not in gpu.command()
    shutil.rmtree(tmp_path / "inference")


def test_a_small_machine_gives_every_core_to_the_cpu_model_unless_told_otherwise(tmp_path: Path) -> None:
    default, two = InferenceConfig(engine="vllm"), InferenceConfig(engine="vllm", cpu_reserved_cores=2)
    shared = {RESERVED_CPUS_ENV: "0", THREADS_BIND_ENV: "nobind", "OMP_WAIT_POLICY": "PASSIVE"}
    assert cpu_threading_env(default, {}, cores=2) == shared  # vLLM's 1 core kept would halve the model's
    assert cpu_threading_env(default, {}, cores=4) == shared
    assert cpu_threading_env(default, {}, cores=16) == {}  # vLLM's own choices
    caller = {RESERVED_CPUS_ENV: "1", THREADS_BIND_ENV: "0-1"}
    assert cpu_threading_env(default, caller, cores=2) == {"OMP_WAIT_POLICY": "PASSIVE"}  # the caller's kept
    assert cpu_threading_env(two, caller, cores=16) == {RESERVED_CPUS_ENV: "2"}  # the job file's wins
    server = VLLMServer(ModelSpec(name=str(tmp_path)), two, "key", 8123, tmp_path / "log", build="cpu")
    assert server.environment()[RESERVED_CPUS_ENV] == "2"
    gpu = VLLMServer(ModelSpec(name=str(tmp_path)), two, "key", 8123, tmp_path / "log", build="gpu")
    assert gpu.environment().get(RESERVED_CPUS_ENV) == os.environ.get(RESERVED_CPUS_ENV)  # GPU builds: untouched


def test_grpo_on_a_server_that_never_comes_names_its_endpoint_folder(tmp_path: Path) -> None:
    from lm_models import small_tiny_model
    from rlplex.models.hf import load_causal_lm
    from rlplex.runners.grpo_vllm import ServedLoRAPolicy

    folder = tmp_path / "nobody"
    folder.mkdir()
    (folder / API_KEY_FILE).write_text("key")
    spec = ModelSpec(name=str(small_tiny_model()))
    inference = InferenceConfig(engine="vllm", endpoint_dir=str(folder), reconnect_timeout_s=0.3)
    policy = ServedLoRAPolicy(spec, load_causal_lm(spec), inference, 4, tmp_path)
    assert policy.server is None and policy.start() == 0.0  # it starts none of its own
    try:
        with pytest.raises(InferenceUnavailableError, match=r"nobody: no inference endpoint after 0\.3 s"):
            policy.client().load_adapter("policy-w0", tmp_path / "adapter")
    finally:
        policy.close()


def test_a_servers_port_is_free_and_below_the_ephemeral_range() -> None:
    """A port drawn for a vLLM server (bound tens of seconds later) is one the kernel never hands
    to a socket bound to port 0 meanwhile: a collision once sent the tests' health checks to a
    node's RPC listener."""
    import socket

    from rlplex.inference.vllm_server import _ephemeral_low, free_port

    for _ in range(20):
        port = free_port("127.0.0.1")
        assert 1024 <= port < _ephemeral_low()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))  # still free
