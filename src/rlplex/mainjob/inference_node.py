"""The main job's inference role: one node that runs the job's vLLM server replicas.

It starts `replicas` servers on the job's model (loopback unless `[inference] host` says
otherwise, the job's API key required), waits until each answers `/health`, then publishes
their URLs in `inference/endpoint.json` with this node's incarnation. From then on it checks
every replica each `health_interval_s`: a server process that exited, one whose `/health` has
failed for `hang_timeout_s`, or one whose engine completed no one-token request for as long
while `/health` answers (an engine core stopped or deadlocked behind a live API process)
fails the node with the server's log tail or its processes' states. The PrimeMaster
restarts a failed node (the role's restart budget), which starts fresh servers; orchestrators
wait for the new endpoint, load their adapters again and redo the step they were generating.
"""

from __future__ import annotations

import logging
import threading
import time

from rlplex.config import StrictModel
from rlplex.control.node.worker import WorkerContext, WorkerLoad
from rlplex.errors import InferenceUnavailableError
from rlplex.inference.config import InferenceConfig
from rlplex.inference.vllm_server import (
    Endpoint,
    VLLMServer,
    clear_endpoint,
    free_port,
    read_api_key,
    require_vllm,
    write_endpoint,
)
from rlplex.mainjob.config import INFERENCE_DIR
from rlplex.models.spec import ModelSpec

log = logging.getLogger(__name__)


class InferenceNodeConfig(StrictModel):
    """`[roles.inference.config]`: the job's `[inference]` and `[model]` tables."""

    inference: InferenceConfig
    model: ModelSpec


class InferenceNode(WorkerLoad):
    config_model = InferenceNodeConfig

    def __init__(self, context: WorkerContext) -> None:
        super().__init__(context)
        config = InferenceNodeConfig.model_validate(context.config)
        self.config, self.model = config.inference, config.model
        self.endpoint_dir = context.output_dir / INFERENCE_DIR
        self.servers: list[VLLMServer] = []

    def self_check(self) -> None:
        require_vllm(self.model)
        read_api_key(self.endpoint_dir)

    def run(self) -> None:
        build = require_vllm(self.model)
        key = read_api_key(self.endpoint_dir)
        clear_endpoint(self.endpoint_dir)  # a dead predecessor's URLs must not be used
        incarnation = self.context.incarnation
        try:
            for replica in range(self.config.replicas):
                port = self.config.port + replica if self.config.port else free_port(self.config.host)
                log_path = self.endpoint_dir / f"server_{replica}.log"
                server = VLLMServer(self.model, self.config, key, port, log_path, build)
                server.start()
                self.servers.append(server)
                log.warning("inference: started vLLM replica %d (pid %s) on %s", replica, server.pid, server.url)
            for replica, server in enumerate(self.servers):
                seconds = server.wait_ready(self.config.startup_timeout_s, self.context.should_stop)
                log.warning("inference: replica %d ready after %.1f s", replica, seconds)
            write_endpoint(self.endpoint_dir, Endpoint(tuple(s.url for s in self.servers), incarnation))
            self.context.report_progress(ready=1.0, replicas=float(len(self.servers)))
            self._watch()
        finally:
            clear_endpoint(self.endpoint_dir)
            for server in self.servers:
                server.stop()

    def _watch(self) -> None:
        interval, hang_s = self.config.health_interval_s, self.config.hang_timeout_s
        last_healthy = [time.monotonic()] * len(self.servers)
        probes = [
            EngineProbe(server, max(interval, hang_s / 4), hang_s, self.context.stop_event) for server in self.servers
        ]
        checks = 0
        while not self.context.stop_event.wait(interval):
            now = time.monotonic()
            for replica, (server, probe) in enumerate(zip(self.servers, probes, strict=True)):
                if not server.alive():
                    code = server.process.returncode if server.process is not None else None
                    raise InferenceUnavailableError(
                        f"vLLM replica {replica} (port {server.port}) exited with code {code}; "
                        f"{server.log_path}:\n{server.log_tail()}"
                    )
                if server.healthy(timeout_s=min(5.0, hang_s)):
                    last_healthy[replica] = now = time.monotonic()
                elif now - last_healthy[replica] > hang_s:
                    raise InferenceUnavailableError(
                        f"vLLM replica {replica} (port {server.port}) has not answered /health for {hang_s:g} s "
                        f"({server.process_states()}): restarting it"
                    )
                if now - probe.last_done > hang_s:
                    raise InferenceUnavailableError(
                        f"vLLM replica {replica} (port {server.port}) answers /health but its engine completed no "
                        f"one-token request for {hang_s:g} s ({server.process_states()}): restarting it"
                    )
            checks += 1
            self.context.report_progress(ready=1.0, health_checks=float(checks))


class EngineProbe:
    """A one-token request to a replica every `every_s`, each allowed `timeout_s`, from a thread of
    its own (a hung engine holds the request, never the node's watch). `last_done` is when one
    last came back: an engine that makes no progress behind a live API shows as it grows old."""

    def __init__(self, server: VLLMServer, every_s: float, timeout_s: float, stop: threading.Event) -> None:
        self.server, self.every_s, self.timeout_s, self.stop = server, every_s, timeout_s, stop
        self.last_done = time.monotonic()
        threading.Thread(target=self._loop, name=f"rlplex-engine-probe-{server.port}", daemon=True).start()

    def _loop(self) -> None:
        while not self.stop.wait(self.every_s):
            if self.server.completes_a_token(self.timeout_s):
                self.last_done = time.monotonic()
