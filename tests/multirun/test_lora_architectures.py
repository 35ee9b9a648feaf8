"""MultiLoRA on real Hugging Face architectures (random tiny GPT-2, Qwen2, Llama built from configs).

GPT-2 keeps its projections in transformers' Conv1D (weight [in, out]); Qwen2 and Llama in
nn.Linear. Each must get its family's default targets, reproduce the base model with fresh
adapters, route mixed batches row by row, and export adapters that peft loads as they are.
"""

from __future__ import annotations

import copy
import functools
import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from rlplex.errors import AdapterError
from rlplex.multirun import MultiLoRALinear, apply_multi_lora, write_peft_adapter
from rlplex.multirun.rundir.peft_export import ADAPTER_CONFIG
from rlplex.multirun.trainer.lora import grouped_mm_available
from rlplex.multirun.trainer.lora_apply import (
    DEFAULT_TARGET_MODULES,
    GPT2_TARGET_MODULES,
    MultiLoRAModules,
    default_target_modules,
)

VOCAB = 100
ARCHS = ["gpt2", "qwen2", "llama"]
MAX_RANK = 8


@functools.cache
def _base(arch: str) -> nn.Module:
    """A random tiny model of ``arch``; tests take deep copies."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64)).eval()
    decoder = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**decoder)).eval()
    return LlamaForCausalLM(LlamaConfig(**decoder)).eval()


def _expected_modules(arch: str) -> set[str]:
    if arch == "gpt2":
        return {
            f"transformer.h.{i}.{m}" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
        }
    attention = [f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    mlp = [f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    return {f"model.layers.{i}.{m}" for i in range(2) for m in attention + mlp}


def _with_adapters(
    arch: str, ranks: tuple[int, ...] = (8, 5), alphas: tuple[float, ...] = (16.0, 7.5)
) -> tuple[nn.Module, MultiLoRAModules]:
    """A copy of the base with len(ranks) nonzero adapters of those ranks and alphas."""
    model = copy.deepcopy(_base(arch))
    lora = apply_multi_lora(model, rank=MAX_RANK, n_adapters=len(ranks))
    gen = torch.Generator().manual_seed(1)
    for run, (r, alpha) in enumerate(zip(ranks, alphas, strict=True)):
        lora.lora_ranks[run] = r
        lora.scaling_factors[run] = alpha / r
        with torch.no_grad():
            for name, param in lora.named_parameters_for_adapter(run):
                param.copy_(torch.randn(param.shape, generator=gen) * (0.3 if name.endswith("lora_A.weight") else 0.2))
    return model, lora


def _tokens(rows: int, seed: int) -> Tensor:
    return torch.randint(0, VOCAB, (rows, 10), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
def test_defaults_wrap_the_family_layers_and_fresh_adapters_change_nothing(arch: str) -> None:
    base = _base(arch)
    assert default_target_modules(base) == (GPT2_TARGET_MODULES if arch == "gpt2" else DEFAULT_TARGET_MODULES)
    model = copy.deepcopy(base)
    lora = apply_multi_lora(model, rank=4, n_adapters=3)
    assert set(lora.modules) == _expected_modules(arch)
    assert lora.fan_in_fan_out == (arch == "gpt2")
    assert lora.target_modules == tuple(sorted(default_target_modules(base)))
    for name, module in lora.modules.items():
        assert model.get_submodule(name) is module
        assert isinstance(module, MultiLoRALinear)
    if arch == "gpt2":
        c_attn = lora.modules["transformer.h.0.attn.c_attn"]
        assert (c_attn.in_features, c_attn.out_features) == (32, 96)
        assert c_attn.lora_A[0].shape == (4, 32) and c_attn.lora_B[0].shape == (96, 4)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)

    tokens = _tokens(3, seed=0)
    with torch.no_grad():
        expected = base(tokens).logits
        with lora.active_adapters(torch.tensor([0, 2, -1])):
            got = model(tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_mixed_batch_equals_each_adapters_rows_alone(arch: str) -> None:
    model, lora = _with_adapters(arch)
    tokens = _tokens(5, seed=1)
    ids = torch.tensor([1, 0, -1, 1, 0])
    with lora.active_adapters(ids):
        mixed = model(tokens).logits
    mixed.square().mean(-1).sum().backward()
    mixed_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert len(mixed_grads) == 2 * 2 * len(lora.modules)
    model.zero_grad(set_to_none=True)

    for run in (-1, 0, 1):
        rows = (ids == run).nonzero().squeeze(1)
        with lora.active_adapters(torch.full((len(rows),), run)):
            alone = model(tokens[rows]).logits
        torch.testing.assert_close(mixed[rows], alone, rtol=1e-5, atol=1e-5)
        if run != -1:  # base-only rows reach no trainable parameter
            alone.square().mean(-1).sum().backward()
    for name, grad in mixed_grads.items():
        param = model.get_parameter(name)
        assert param.grad is not None
        torch.testing.assert_close(grad, param.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not grouped_mm_available(), reason="this torch has no grouped_mm")
@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_the_grouped_path_equals_the_loop_path_in_a_model(arch: str) -> None:
    model, lora = _with_adapters(arch, ranks=(8, 3, 6), alphas=(16.0, 3.0, 12.0))
    tokens, ids = _tokens(6, seed=2), torch.tensor([2, 0, 1, -1, 2, 1])
    logits = []
    for grouped in (False, True):
        lora.set_grouped_mm(grouped)
        with torch.no_grad(), lora.active_adapters(ids):
            logits.append(model(tokens).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_float32_lora_on_a_bf16_model_trains_float32_leaves() -> None:
    float_model, float_lora = _with_adapters("llama")
    models, loras = [], []
    for lora_dtype in (torch.float32, torch.bfloat16):
        model = copy.deepcopy(_base("llama")).to(torch.bfloat16)
        lora = apply_multi_lora(model, rank=MAX_RANK, n_adapters=2, lora_dtype=lora_dtype)
        with torch.no_grad():
            for run in range(2):
                pairs = zip(
                    lora.named_parameters_for_adapter(run), float_lora.named_parameters_for_adapter(run), strict=True
                )
                for (_, param), (_, value) in pairs:
                    param.copy_(value)
        lora.lora_ranks.copy_(float_lora.lora_ranks)
        lora.scaling_factors.copy_(float_lora.scaling_factors)
        models.append(model)
        loras.append(lora)
    tokens, ids = _tokens(4, seed=3), torch.tensor([1, 0, 0, 1])
    with torch.no_grad(), float_lora.active_adapters(ids):
        float_logits = float_model(tokens).logits
    for grouped in [False, True] if grouped_mm_available() else [False]:
        logits = []
        for model, lora in zip(models, loras, strict=True):
            lora.set_grouped_mm(grouped)
            model.zero_grad(set_to_none=True)
            with lora.active_adapters(ids):
                logits.append(model(tokens).logits)
            logits[-1].float().logsumexp(-1).sum().backward()
        assert logits[0].dtype == torch.bfloat16
        if grouped:  # the scaling is applied to B before B is rounded to bf16: other rounding, close
            error = float((logits[0] - logits[1]).detach().double().norm() / logits[1].detach().double().norm())
            assert error < 3e-2
        else:  # the float32 weights, rounded on the fly, are the bf16 model's weights: same numbers
            assert torch.equal(logits[0], logits[1])
        error = float((logits[0].detach().double() - float_logits.double()).norm() / float_logits.double().norm())
        assert error < 5e-2, f"grouped={grouped}: bf16 logits off by {error:.4f} from float32"
        grads = [p.grad for run in range(2) for _, p in loras[0].named_parameters_for_adapter(run)]
        assert all(g is not None and g.dtype == torch.float32 and bool(g.abs().sum() > 0) for g in grads)
        assert all(
            p.dtype == torch.float32
            for p in loras[0].modules["model.layers.0.mlp.up_proj"].parameters()
            if p.requires_grad
        )


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_an_exported_adapter_loads_in_peft_with_equal_logits(arch: str, tmp_path: Path) -> None:
    from peft import PeftModel

    model, lora = _with_adapters(arch)
    run, rank, alpha = 1, 5, 7.5
    directory = write_peft_adapter(
        tmp_path / "broadcast" / "step_1",
        lora.adapter_state_dict(run),
        _base(arch).config,
        rank=rank,
        alpha=alpha,
        target_modules=lora.target_modules,
        fan_in_fan_out=lora.fan_in_fan_out,
    )
    assert json.loads((directory / ADAPTER_CONFIG).read_text())["fan_in_fan_out"] is (arch == "gpt2")
    with warnings.catch_warnings():
        # peft warns (and overrides the file) when fan_in_fan_out disagrees with the layer type
        warnings.filterwarnings("error", message=".*fan_in_fan_out.*")
        peft_model = PeftModel.from_pretrained(copy.deepcopy(_base(arch)), str(directory)).eval()
    tokens = _tokens(3, seed=4)
    with torch.no_grad():
        expected = peft_model(tokens).logits
        with lora.active_adapters(torch.full((3,), run)):
            got = model(tokens).logits
        plain = _base(arch)(tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (got - plain).abs().max() > 1e-2, "the adapter must change the output for this test to mean anything"


def test_unmatched_targets_are_each_named_with_the_layers_the_model_has() -> None:
    model = copy.deepcopy(_base("gpt2"))
    with pytest.raises(AdapterError) as error:
        apply_multi_lora(model, target_modules=["c_attn", "q_proj", "v_proj"], n_adapters=2)
    message = str(error.value)
    assert "target_modules ['q_proj', 'v_proj'] match no nn.Linear or Conv1D layer of GPT2LMHeadModel" in message
    assert message.endswith("its layers are named ['c_attn', 'c_fc', 'c_proj', 'lm_head']")
    with pytest.raises(AdapterError, match="must be a list of names, not a str"):
        apply_multi_lora(model, target_modules="c_attn", n_adapters=2)


class _Head(nn.Module):
    """An unknown architecture: the all-linear rule applies, without the output head."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.ModuleDict({"up": nn.Linear(8, 16), "down": nn.Linear(16, 8), "norm": nn.LayerNorm(8)})
        self.out = nn.Linear(8, 5)

    def get_output_embeddings(self) -> nn.Module:
        return self.out


def test_an_unknown_architecture_gets_every_linear_but_its_output_head() -> None:
    assert default_target_modules(_Head()) == ("down", "up")
    lora = apply_multi_lora(_Head(), n_adapters=1)
    assert sorted(lora.modules) == ["block.down", "block.up"]
    with pytest.raises(AdapterError, match=r"has no nn\.Linear or Conv1D layer besides its output head"):
        default_target_modules(nn.Sequential(nn.ReLU()))
    head_only = nn.Module()
    head_only.lm_head = nn.Linear(4, 4)
    with pytest.raises(AdapterError, match="pass target_modules"):
        apply_multi_lora(head_only, n_adapters=1)
