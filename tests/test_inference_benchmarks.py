"""The pure helpers of benchmarks/inference_rollouts.py and benchmarks/adapter_freshness.py (no
server is started and no checkpoint is built: the benchmarks themselves do that)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from benchmarks.adapter_freshness import newest_stable, summary
from benchmarks.inference_common import (
    PROJECTIONS,
    QWEN2_150M,
    count_parameters,
    kv_cache_gb,
    lora_state,
    projection_shapes,
)
from benchmarks.inference_rollouts import threads_per_process

from rlplex.multirun.orchestrator.policy import read_peft_adapter
from rlplex.multirun.rundir.peft_export import STABLE_MARKER, write_peft_adapter

SMALL: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 50,
}


def test_the_random_qwen2_has_about_150m_parameters_and_a_cpu_head_size() -> None:
    assert 140e6 < count_parameters(QWEN2_150M, vocab=265) < 160e6
    assert QWEN2_150M["hidden_size"] // QWEN2_150M["num_attention_heads"] == 64


def test_a_random_adapter_covers_every_projection_and_reads_back_as_peft(tmp_path: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(**SMALL, tie_word_embeddings=True))
    linear = {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    linear.pop("lm_head")
    assert projection_shapes(SMALL) == linear
    assert count_parameters(SMALL) == sum(p.numel() for p in model.parameters())

    state = lora_state(SMALL, rank=4, seed=1)
    assert all(bool(t.abs().sum() > 0) for t in state.values())  # B is not zero: the adapter matters
    assert torch.equal(
        state["model.layers.0.mlp.down_proj.lora_B.weight"],
        lora_state(SMALL, 4, 1)["model.layers.0.mlp.down_proj.lora_B.weight"],
    )
    write_peft_adapter(tmp_path / "a", state, None, 4, 8.0, PROJECTIONS)
    adapter = read_peft_adapter(tmp_path / "a")
    assert adapter.rank == 4 and set(adapter.modules) == set(linear)


def test_kv_cache_is_sized_for_every_sequence_in_whole_gib() -> None:
    assert kv_cache_gb(SMALL, 256, 72) == 1
    # 150M: 12 layers x 2 x 1024 x 4 bytes = 96 KiB a token; (256 x 3 + 1) blocks of 32 tokens = 2.25 GiB
    assert kv_cache_gb(QWEN2_150M, 256, 72) == 3
    assert kv_cache_gb(QWEN2_150M, 256, 72, dtype_bytes=2) == 2  # bfloat16: 1.13 GiB
    assert kv_cache_gb(QWEN2_150M, 255, 72, block_tokens=128) == 3  # 256 blocks of 12 MiB: exactly 3 GiB
    assert kv_cache_gb(QWEN2_150M, 256, 72, block_tokens=128) == 4  # one more block


def test_threads_are_split_between_the_hf_processes() -> None:
    assert threads_per_process(2, 4) == 1
    assert threads_per_process(8, 4) == 2


def test_the_watcher_takes_only_the_newest_stable_step(tmp_path: Path) -> None:
    broadcast = tmp_path / "broadcast"
    assert newest_stable(broadcast, -1) is None  # not there yet
    state = lora_state(SMALL, rank=2, seed=0)
    for step in (0, 1):
        write_peft_adapter(broadcast / f"step_{step}", state, None, 2, 4.0, PROJECTIONS)
    (broadcast / "step_2").mkdir()  # being written: no marker yet
    (broadcast / ".step_3.tmp-1").mkdir()
    assert newest_stable(broadcast, -1) == (1, broadcast / "step_1")
    assert newest_stable(broadcast, 1) is None
    (broadcast / "step_2" / "adapter_model.safetensors").write_bytes(b"x")
    (broadcast / "step_2" / STABLE_MARKER).write_bytes(b"")
    assert newest_stable(broadcast, 1) == (2, broadcast / "step_2")


def test_summary_percentiles() -> None:
    stats = summary([float(v) for v in range(1, 101)])
    assert stats["p50"] == pytest.approx(50.5)
    assert stats["p99"] == pytest.approx(99.01)
    assert stats["max"] == 100.0
