"""MultiLoRALinear maths against K separate LoRA layers, per-run isolation, registration, errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from rlplex.errors import AdapterError
from rlplex.multirun import AdapterBatch, MultiLoRALinear, apply_multi_lora

IN, OUT, MAX_RANK = 20, 12, 6


class FakeManager:
    """Smallest stand-in for the MultiRunManager side of the interface (the manager is built elsewhere)."""

    def __init__(self, max_runs: int) -> None:
        self.scaling_factors = torch.full((max_runs,), 1e6)
        self.lora_ranks = torch.full((max_runs,), MAX_RANK, dtype=torch.long)
        self.adapter_batch = AdapterBatch()
        self.registered: dict[str, MultiLoRALinear] = {}

    def register_lora_module(self, module_name: str, module: MultiLoRALinear) -> None:
        self.registered[module_name] = module


def _layer(k: int, dtype: torch.dtype, seed: int = 0) -> tuple[MultiLoRALinear, list[int], list[float]]:
    """A MultiLoRALinear with nonzero adapters, per-run ranks 1..MAX_RANK and per-run scalings."""
    gen = torch.Generator().manual_seed(seed)
    base = nn.Linear(IN, OUT, dtype=dtype)
    with torch.no_grad():
        base.weight.copy_(torch.randn(OUT, IN, generator=gen, dtype=dtype) * 0.2)
        base.bias.copy_(torch.randn(OUT, generator=gen, dtype=dtype))
    layer = MultiLoRALinear(base, rank=MAX_RANK, n_adapters=k, alpha=8.0)
    ranks = [int(r) for r in torch.randint(1, MAX_RANK + 1, (k,), generator=gen)]
    scales = [float(a) / r for a, r in zip(torch.randint(1, 9, (k,), generator=gen), ranks, strict=True)]
    with torch.no_grad():
        for idx in range(k):
            layer.lora_A[idx].copy_(torch.randn(MAX_RANK, IN, generator=gen, dtype=dtype) * 0.3)
            layer.lora_B[idx].copy_(torch.randn(OUT, MAX_RANK, generator=gen, dtype=dtype) * 0.1)
            layer.lora_ranks[idx] = ranks[idx]
            layer.scaling_factors[idx] = scales[idx]
    return layer, ranks, scales


class SeparateLoRA(nn.Module):
    """A plain LoRA layer of rank r: the reference the multi-adapter layer must equal."""

    def __init__(self, base: nn.Linear, a: Tensor, b: Tensor, scale: float) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(a.shape[1], a.shape[0], bias=False, dtype=a.dtype)
        self.lora_B = nn.Linear(b.shape[1], b.shape[0], bias=False, dtype=b.dtype)
        with torch.no_grad():
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.copy_(b)
        self.scale = scale

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-10, "atol": 1e-10}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("shape", [(97,), (5, 13)])
def test_outputs_and_gradients_equal_separate_layers(k: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    layer, ranks, scales = _layer(k, dtype, seed=k)
    gen = torch.Generator().manual_seed(100 + k)
    ids = torch.randint(-1, k, shape, generator=gen)
    x = torch.randn(*shape, IN, generator=gen, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(*shape, OUT, generator=gen, dtype=dtype)

    y = layer(x, ids)
    y.backward(grad_out)

    base = copy.deepcopy(layer.base_layer)
    refs = [
        SeparateLoRA(base, layer.lora_A[i].detach()[: ranks[i]], layer.lora_B[i].detach()[:, : ranks[i]], scales[i])
        for i in range(k)
    ]
    x_ref = x.detach().clone().requires_grad_(True)
    flat_x, flat_ids, flat_g = x_ref.reshape(-1, IN), ids.reshape(-1), grad_out.reshape(-1, OUT)
    y_ref = torch.empty_like(flat_g)
    total = torch.zeros((), dtype=dtype)
    for run in range(-1, k):
        rows = (flat_ids == run).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        out = base(flat_x[rows]) if run == -1 else refs[run](flat_x[rows])
        y_ref[rows] = out.detach()
        total = total + (out * flat_g[rows]).sum()
    total.backward()

    torch.testing.assert_close(y.reshape(-1, OUT), y_ref, **_tol(dtype))
    torch.testing.assert_close(x.grad, x_ref.grad, **_tol(dtype))
    assert layer.base_layer.weight.grad is None
    for i in range(k):
        grad_a, grad_b = layer.lora_A[i].grad, layer.lora_B[i].grad
        if not (ids == i).any():
            assert grad_a is None and grad_b is None, f"slot {i} was not in the batch but got a gradient"
            continue
        assert grad_a is not None and grad_b is not None
        torch.testing.assert_close(grad_a[: ranks[i]], refs[i].lora_A.weight.grad, **_tol(dtype))
        torch.testing.assert_close(grad_b[:, : ranks[i]], refs[i].lora_B.weight.grad, **_tol(dtype))
        # rows and columns beyond the run's real rank take no part
        assert torch.count_nonzero(grad_a[ranks[i] :]) == 0
        assert torch.count_nonzero(grad_b[:, ranks[i] :]) == 0


def test_batch_of_one_adapter_and_of_no_adapter() -> None:
    layer, _, _ = _layer(4, torch.float64)
    x = torch.randn(30, IN, dtype=torch.float64)
    base_only = layer(x, torch.full((30,), -1))
    torch.testing.assert_close(base_only, layer.base_layer(x))
    single = layer(x, torch.full((30,), 2))
    mixed = layer(torch.cat([x, x]), torch.cat([torch.full((30,), 2), torch.full((30,), 0)]))
    torch.testing.assert_close(single, mixed[:30])
    assert not torch.allclose(single, base_only)


def test_one_id_per_row_equals_one_id_per_token() -> None:
    layer, _, _ = _layer(3, torch.float64)
    x = torch.randn(4, 7, IN, dtype=torch.float64)
    rows = torch.tensor([2, -1, 0, 2])
    torch.testing.assert_close(layer(x, rows), layer(x, rows[:, None].expand(4, 7)))


def test_grouped_mm_path_equals_segment_loop() -> None:
    # CPU grouped_mm has no backward and wants 16-byte aligned fp32 rows: compare forward only.
    base = nn.Linear(32, 16)
    layer = MultiLoRALinear(base, rank=8, n_adapters=5, alpha=8.0)
    with torch.no_grad():
        for idx in range(5):
            layer.lora_B[idx].normal_()
    layer.lora_ranks.copy_(torch.tensor([8, 4, 2, 8, 1]))
    layer.scaling_factors.copy_(torch.tensor([1.0, 2.0, 4.0, 0.5, 3.0]))
    x = torch.randn(200, 32)
    ids = torch.randint(-1, 5, (200,))
    with torch.no_grad():
        layer.use_grouped_mm = False
        expected = layer(x, ids)
        layer.use_grouped_mm = True
        got = layer(x, ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_stepping_one_runs_optimizer_leaves_the_others_untouched() -> None:
    layer, _, _ = _layer(3, torch.float32)
    opts = [
        torch.optim.AdamW(dict(layer.named_parameters_for_adapter(i)).values(), lr=0.1, weight_decay=0.1)
        for i in range(3)
    ]
    before = [[p.detach().clone() for _, p in layer.named_parameters_for_adapter(i)] for i in range(3)]
    ids = torch.tensor([0, 1, 0, 1, 2, -1] * 5)
    for _ in range(3):
        layer(torch.randn(30, IN), ids).square().sum().backward()
        opts[0].step()
    for i in (1, 2):
        for p, old in zip((p for _, p in layer.named_parameters_for_adapter(i)), before[i], strict=True):
            assert torch.equal(p, old), f"run {i} changed when only run 0 stepped"
    assert not torch.equal(layer.lora_A[0], before[0][0])


def test_run_trained_beside_another_equals_the_run_trained_alone() -> None:
    torch.manual_seed(0)
    xs = [torch.randn(16, IN) for _ in range(4)]
    others = [torch.randn(24, IN) for _ in range(4)]

    def train(mixed: bool) -> list[Tensor]:
        layer, _, _ = _layer(2, torch.float64)
        opt = torch.optim.Adam(dict(layer.named_parameters_for_adapter(0)).values(), lr=0.05)
        opt_other = torch.optim.Adam(dict(layer.named_parameters_for_adapter(1)).values(), lr=0.3)
        for x, other in zip(xs, others, strict=True):
            x = x.double()
            if mixed:
                y = layer(torch.cat([x, other.double()]), torch.tensor([0] * 16 + [1] * 24))
                loss = y[:16].square().mean() + y[16:].abs().mean()
            else:
                loss = layer(x, torch.zeros(16, dtype=torch.long)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if mixed:
                opt_other.step()
                opt_other.zero_grad()
        return [p.detach() for _, p in layer.named_parameters_for_adapter(0)]

    for alone, beside in zip(train(False), train(True), strict=True):
        torch.testing.assert_close(beside, alone, rtol=1e-10, atol=1e-10)


def test_registration_reads_manager_state_at_forward_time() -> None:
    manager = FakeManager(3)
    layer = MultiLoRALinear(nn.Linear(IN, OUT), rank=MAX_RANK, n_adapters=3)
    layer.register_with_runs(manager, "model.layers.0.q_proj")
    assert manager.registered == {"model.layers.0.q_proj": layer}
    with torch.no_grad():
        layer.lora_B[1].normal_()
    x = torch.randn(8, IN)
    base = layer.base_layer(x)
    with manager.adapter_batch.active(torch.ones(8, dtype=torch.long)):
        # an empty slot's 1e6 scaling makes misuse loud
        assert (layer(x) - base).abs().max() > 1e3
        manager.scaling_factors[1] = 2.0
        full = layer(x) - base
        manager.lora_ranks[1] = 2
        low = layer(x) - base
    assert manager.adapter_batch.ids is None
    hidden = x @ layer.lora_A[1].detach()[:2].T
    torch.testing.assert_close(low, 2.0 * hidden @ layer.lora_B[1].detach()[:, :2].T, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(full, low)


def test_adapter_state_dict_is_sliced_to_the_real_rank_and_loads_back() -> None:
    layer, ranks, _ = _layer(3, torch.float32)
    state = layer.adapter_state_dict(1)
    assert state["lora_A.weight"].shape == (ranks[1], IN)
    assert state["lora_B.weight"].shape == (OUT, ranks[1])
    other = MultiLoRALinear(copy.deepcopy(layer.base_layer), rank=MAX_RANK, n_adapters=3)
    other.load_adapter_state_dict(2, state)
    other.lora_ranks[2] = ranks[1]
    other.scaling_factors[2] = float(layer.scaling_factors[1])
    x = torch.randn(9, IN)
    torch.testing.assert_close(other(x, torch.full((9,), 2)), layer(x, torch.full((9,), 1)))
    with pytest.raises(AdapterError, match="do not fit"):
        other.load_adapter_state_dict(0, {"lora_A.weight": torch.zeros(7, IN), "lora_B.weight": torch.zeros(OUT, 7)})


def test_reset_adapter_restores_the_base_output_and_drops_gradients() -> None:
    layer, _, _ = _layer(2, torch.float32)
    x = torch.randn(6, IN)
    layer(x, torch.zeros(6, dtype=torch.long)).sum().backward()
    assert layer.lora_A[0].grad is not None
    layer.reset_adapter(0)
    assert layer.lora_A[0].grad is None and torch.count_nonzero(layer.lora_B[0]) == 0
    assert torch.count_nonzero(layer.lora_A[0]) > 0
    torch.testing.assert_close(layer(x, torch.zeros(6, dtype=torch.long)), layer.base_layer(x))


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        (torch.tensor([0, 3]), r"in \[-1, 3\)"),
        (torch.tensor([-2, 0]), r"in \[-1, 3\)"),
        (torch.tensor([0, 1, 2]), "do not fit input"),
    ],
)
def test_bad_adapter_ids_are_refused(ids: Tensor, match: str) -> None:
    layer, _, _ = _layer(3, torch.float32)
    with pytest.raises(AdapterError, match=match):
        layer(torch.randn(2, IN), ids)


def test_missing_ids_bad_rank_and_bad_manager_are_refused() -> None:
    layer, _, _ = _layer(3, torch.float32)
    with pytest.raises(AdapterError, match="no adapter ids"):
        layer(torch.randn(2, IN))
    layer.lora_ranks[1] = MAX_RANK + 1
    with pytest.raises(AdapterError, match=r"lora_ranks\[1\] = 7"):
        layer(torch.randn(2, IN), torch.tensor([1, 0]))
    with pytest.raises(AdapterError, match=r"scaling_factors must be a tensor of shape \(3,\), got \(4,\)"):
        layer.register_with_runs(FakeManager(4), "q_proj")  # type: ignore[arg-type]


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
    )
    return LlamaForCausalLM(config)


def test_apply_multi_lora_replaces_targets_and_freezes_the_base() -> None:
    model = _tiny_llama()
    manager = FakeManager(3)
    lora = apply_multi_lora(model, target_modules=("q_proj", "v_proj", "down_proj"), rank=4, manager=manager)
    assert sorted(manager.registered) == sorted(lora.modules)
    assert "model.layers.1.mlp.down_proj" in lora.modules and len(lora.modules) == 6
    assert isinstance(model.get_submodule("model.layers.0.self_attn.q_proj"), MultiLoRALinear)
    assert isinstance(model.get_submodule("model.layers.0.self_attn.k_proj"), nn.Linear)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    names = [name for name, _ in lora.named_parameters_for_adapter(2)]
    assert names[0] == "model.layers.0.self_attn.q_proj.lora_A.weight" and len(names) == 12
    with pytest.raises(AdapterError, match=r"no nn\.Linear module matches"):
        apply_multi_lora(_tiny_llama(), target_modules=("nope",), rank=4, n_adapters=2)
