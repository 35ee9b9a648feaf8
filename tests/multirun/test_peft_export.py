"""A run's adapter exported in the PEFT layout loads with peft and reproduces the MultiLoRA model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from rlplex.errors import AdapterError
from rlplex.multirun import apply_multi_lora, write_peft_adapter
from rlplex.multirun.rundir.peft_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, STABLE_MARKER, is_stable_adapter

TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")
MAX_RANK = 8
RUN_RANKS = [8, 3, 5]
RUN_ALPHAS = [16.0, 6.0, 2.5]


def _tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def multi() -> tuple[nn.Module, nn.Module, object]:
    base = _tiny_llama()
    model = copy.deepcopy(base)
    lora = apply_multi_lora(model, target_modules=TARGETS, rank=MAX_RANK, n_adapters=3)
    gen = torch.Generator().manual_seed(1)
    for run, (r, alpha) in enumerate(zip(RUN_RANKS, RUN_ALPHAS, strict=True)):
        lora.lora_ranks[run] = r
        lora.scaling_factors[run] = alpha / r
        with torch.no_grad():
            for name, param in lora.named_parameters_for_adapter(run):
                param.copy_(torch.randn(param.shape, generator=gen) * (0.3 if name.endswith("lora_A.weight") else 0.2))
    return base, model, lora


def _export(lora: object, base: nn.Module, run: int, directory: Path) -> Path:
    return write_peft_adapter(
        directory,
        lora.adapter_state_dict(run),  # type: ignore[attr-defined]
        base.config,
        rank=RUN_RANKS[run],
        alpha=RUN_ALPHAS[run],
        target_modules=TARGETS,
    )


@pytest.mark.parametrize("run", [0, 1])
def test_peft_loads_the_exported_adapter_with_equal_logits(multi, tmp_path: Path, run: int) -> None:  # type: ignore[no-untyped-def]
    from peft import PeftModel

    base, model, lora = multi
    directory = _export(lora, base, run, tmp_path / "broadcast" / "step_3")
    assert sorted(p.name for p in directory.iterdir()) == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS, STABLE_MARKER])
    keys = load_file(str(directory / ADAPTER_WEIGHTS)).keys()
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert json.loads((directory / ADAPTER_CONFIG).read_text())["r"] == RUN_RANKS[run]

    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), str(directory)).eval()
    tokens = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(run))
    with torch.no_grad():
        expected = peft_model(tokens).logits
        with lora.active_adapters(torch.full((3,), run)):
            got = model(tokens).logits
        plain = base(tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (got - plain).abs().max() > 1e-2, "the adapters must change the output for this test to mean anything"


def test_rows_of_a_mixed_batch_match_their_own_runs(multi, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from peft import PeftModel

    base, model, lora = multi
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), lora.active_adapters(torch.tensor([2, -1, 1, 2])):
        mixed = model(tokens).logits
    with torch.no_grad():
        torch.testing.assert_close(mixed[1], base(tokens[1:2]).logits[0], rtol=1e-5, atol=1e-5)
        for run, rows in ((2, [0, 3]), (1, [2])):
            peft_model = PeftModel.from_pretrained(
                copy.deepcopy(base), str(_export(lora, base, run, tmp_path / f"r{run}"))
            )
            torch.testing.assert_close(mixed[rows], peft_model(tokens[rows]).logits, rtol=1e-5, atol=1e-5)


def test_rewrite_replaces_whole_and_a_failed_write_keeps_the_previous_adapter(multi, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    base, _, lora = multi
    directory = _export(lora, base, 0, tmp_path / "step_1")
    first = load_file(str(directory / ADAPTER_WEIGHTS))
    _export(lora, base, 1, directory)
    assert load_file(str(directory / ADAPTER_WEIGHTS)).keys() == first.keys()
    assert json.loads((directory / ADAPTER_CONFIG).read_text())["r"] == RUN_RANKS[1]

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("rlplex.multirun.rundir.peft_export.save_file", disk_full)
    with pytest.raises(AdapterError, match="No space left"):
        _export(lora, base, 2, directory)
    assert is_stable_adapter(directory)
    assert json.loads((directory / ADAPTER_CONFIG).read_text())["r"] == RUN_RANKS[1]
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"], "no temporary folder is left behind"


def test_a_deleted_run_directory_is_not_recreated(multi, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    base, _, lora = multi
    run_dir = tmp_path / "run_gone"
    with pytest.raises(AdapterError, match="no longer exists"):
        _export(lora, base, 0, run_dir / "broadcast" / "step_1")
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({}, "empty"),
        ({"m.q_proj.weight": torch.zeros(3, 3)}, "expected a name ending in"),
        ({"m.q_proj.lora_A.weight": torch.zeros(4, 3), "m.q_proj.lora_B.weight": torch.zeros(3, 4)}, "not of rank 3"),
        ({"m.q_proj.lora_A.weight": torch.zeros(3, 5)}, "without both lora_A and lora_B"),
        (
            {"m.q_proj.lora_A.weight": torch.full((3, 5), float("nan")), "m.q_proj.lora_B.weight": torch.zeros(5, 3)},
            "NaN",
        ),
    ],
)
def test_bad_adapter_states_are_refused(tmp_path: Path, state: dict[str, torch.Tensor], match: str) -> None:
    with pytest.raises(AdapterError, match=match):
        write_peft_adapter(tmp_path / "a", state, "tiny", rank=3, alpha=6.0, target_modules=["q_proj"])
    assert not (tmp_path / "a").exists()


def test_a_file_where_the_broadcast_folder_should_be_is_a_clear_error(multi, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    base, _, lora = multi
    (tmp_path / "broadcast").write_text("not a folder")
    with pytest.raises(AdapterError, match="broadcast is not a directory"):
        _export(lora, base, 0, tmp_path / "broadcast" / "step_1")
    assert (tmp_path / "broadcast").read_text() == "not a folder", "the file is left as it was"
