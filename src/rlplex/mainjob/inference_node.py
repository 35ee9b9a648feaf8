"""The main job's inference role: one node that runs the job's vLLM server replicas.

It starts `replicas` servers on the job's model (loopback unless `[inference] host` says
otherwise, the job's API key required), waits until each answers `/health`, then publishes
their URLs in `inference/endpoint.json` with this node's incarnation. From then on it checks
every replica each `health_interval_s`: a server process that exited, or one whose `/health`
has failed for `hang_timeout_s`, fails the node with the server's log tail. The PrimeMaster
restarts a failed node (the role's restart budget), which starts fresh servers; orchestrators
wait for the new endpoint, load their adapters again and redo the step they were generating.
"""

from __future__ import annotations

import logging
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
        last_healthy = [time.monotonic()] * len(self.servers)
        checks = 0
        while not self.context.stop_event.wait(self.config.health_interval_s):
            for replica, server in enumerate(self.servers):
                if not server.alive():
                    code = server.process.returncode if server.process is not None else None
                    raise InferenceUnavailableError(
                        f"vLLM replica {replica} (port {server.port}) exited with code {code}; "
                        f"{server.log_path}:\n{server.log_tail()}"
                    )
                if server.healthy(timeout_s=min(5.0, self.config.hang_timeout_s)):
                    last_healthy[replica] = time.monotonic()
                elif time.monotonic() - last_healthy[replica] > self.config.hang_timeout_s:
                    raise InferenceUnavailableError(
                        f"vLLM replica {replica} (port {server.port}) has not answered /health for "
                        f"{self.config.hang_timeout_s:g} s: restarting it"
                    )
            checks += 1
            self.context.report_progress(ready=1.0, health_checks=float(checks))
