"""MultiLoRALinear maths against K separate LoRA layers, per-run isolation, registration, errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from rlplex.errors import AdapterError
from rlplex.multirun import AdapterBatch, MultiLoRALinear, apply_multi_lora
from rlplex.multirun.trainer.lora import BatchPlan, grouped_mm_available

# Multiples of 8: grouped_mm wants 16-byte aligned rows in bf16.
IN, OUT, MAX_RANK = 24, 16, 8
HAS_GROUPED_MM = grouped_mm_available()
# precision: (base and activation dtype, LoRA weight dtype)
PRECISIONS = {
    "fp32": (torch.float32, torch.float32),
    "fp64": (torch.float64, torch.float64),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp32_lora_on_bf16": (torch.bfloat16, torch.float32),
}
# grouped_mm takes float32, bf16 and float16 only.
PATHS = [("loop", p) for p in PRECISIONS] + [("grouped", p) for p in PRECISIONS if p != "fp64"]


class FakeManager:
    """Smallest stand-in for the MultiRunManager side of the interface (the manager is built elsewhere)."""

    def __init__(self, max_runs: int) -> None:
        self.scaling_factors = torch.full((max_runs,), 1e6)
        self.lora_ranks = torch.full((max_runs,), MAX_RANK, dtype=torch.long)
        self.adapter_batch = AdapterBatch()
        self.registered: dict[str, MultiLoRALinear] = {}

    def register_lora_module(self, module_name: str, module: MultiLoRALinear) -> None:
        self.registered[module_name] = module


def _layer(
    k: int, dtype: torch.dtype, seed: int = 0, lora_dtype: torch.dtype | None = None
) -> tuple[MultiLoRALinear, list[int], list[float]]:
    """A MultiLoRALinear with nonzero adapters, per-run ranks 1..MAX_RANK and per-run scalings."""
    gen = torch.Generator().manual_seed(seed)
    lora_dtype = lora_dtype or dtype
    base = nn.Linear(IN, OUT, dtype=dtype)
    with torch.no_grad():
        base.weight.copy_(torch.randn(OUT, IN, generator=gen) * 0.2)
        base.bias.copy_(torch.randn(OUT, generator=gen))
    layer = MultiLoRALinear(base, rank=MAX_RANK, n_adapters=k, alpha=8.0, lora_dtype=lora_dtype)
    ranks = [int(r) for r in torch.randint(1, MAX_RANK + 1, (k,), generator=gen)]
    scales = [float(a) / r for a, r in zip(torch.randint(1, 9, (k,), generator=gen), ranks, strict=True)]
    with torch.no_grad():
        for idx in range(k):
            layer.lora_A[idx].copy_(torch.randn(MAX_RANK, IN, generator=gen) * 0.3)
            layer.lora_B[idx].copy_(torch.randn(OUT, MAX_RANK, generator=gen) * 0.1)
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


def _assert_close(got: Tensor, expected: Tensor, dtype: torch.dtype) -> None:
    """Tight for float32/64 against a reference in the same dtype; for bf16 against a float64 reference."""
    if dtype == torch.bfloat16:
        # bf16 rounding leaves ~0.5 % relative error (norm-wise) here; an error of 3 % in the
        # LoRA scaling shows as ~3 % in the LoRA gradients, so 1.5 % separates the two.
        error = float((got.detach().double() - expected.double()).norm() / expected.double().norm())
        assert error < 1.5e-2, f"relative error {error:.4f}"
    else:
        tol = 1e-5 if dtype == torch.float32 else 1e-10
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize(("path", "precision"), PATHS)
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("shape", [(97,), (5, 13)])
@pytest.mark.parametrize("order", ["mixed", "sorted"])
def test_outputs_and_gradients_equal_separate_layers(
    k: int, path: str, precision: str, shape: tuple[int, ...], order: str
) -> None:
    """`sorted`: ids as the trainer packs them (run by run, no base-only token), taken without a gather."""
    if path == "grouped" and not HAS_GROUPED_MM:
        pytest.skip("this torch has no grouped_mm")
    dtype, lora_dtype = PRECISIONS[precision]
    layer, ranks, scales = _layer(k, dtype, seed=k, lora_dtype=lora_dtype)
    layer.use_grouped_mm = path == "grouped"
    gen = torch.Generator().manual_seed(100 + k)
    ids = torch.randint(-1, k, shape, generator=gen)
    if order == "sorted":
        ids = torch.randint(0, k, shape, generator=gen).reshape(-1).sort().values.reshape(shape)
    plan = BatchPlan(ids.reshape(-1), torch.device("cpu"), k)
    assert plan.sorted == (order == "sorted" and plan.single is None)
    x = torch.randn(*shape, IN, generator=gen).to(dtype).requires_grad_(True)
    grad_out = torch.randn(*shape, OUT, generator=gen).to(dtype)

    y = layer(x, ids)
    y.backward(grad_out)

    # bf16 is checked against float64 maths on the same weights, not against bf16 rounding.
    ref_dtype = torch.float64 if dtype == torch.bfloat16 else dtype
    base = copy.deepcopy(layer.base_layer).to(ref_dtype)
    refs = [
        SeparateLoRA(
            base,
            layer.lora_A[i].detach()[: ranks[i]].to(ref_dtype),
            layer.lora_B[i].detach()[:, : ranks[i]].to(ref_dtype),
            scales[i],
        )
        for i in range(k)
    ]
    x_ref = x.detach().to(ref_dtype).requires_grad_(True)
    flat_x, flat_ids, flat_g = x_ref.reshape(-1, IN), ids.reshape(-1), grad_out.to(ref_dtype).reshape(-1, OUT)
    y_ref = torch.empty_like(flat_g)
    total = torch.zeros((), dtype=ref_dtype)
    for run in range(-1, k):
        rows = (flat_ids == run).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        out = base(flat_x[rows]) if run == -1 else refs[run](flat_x[rows])
        y_ref[rows] = out.detach()
        total = total + (out * flat_g[rows]).sum()
    total.backward()

    assert y.dtype == dtype
    _assert_close(y.reshape(-1, OUT), y_ref, dtype)
    assert x.grad is not None and x_ref.grad is not None
    _assert_close(x.grad, x_ref.grad, dtype)
    assert layer.base_layer.weight.grad is None
    for i in range(k):
        grad_a, grad_b = layer.lora_A[i].grad, layer.lora_B[i].grad
        if not (ids == i).any():
            assert grad_a is None and grad_b is None, f"slot {i} was not in the batch but got a gradient"
            continue
        assert grad_a is not None and grad_b is not None
        assert grad_a.dtype == grad_b.dtype == lora_dtype, "gradients land in the LoRA weights' own dtype"
        _assert_close(grad_a[: ranks[i]], refs[i].lora_A.weight.grad, dtype)
        _assert_close(grad_b[:, : ranks[i]], refs[i].lora_B.weight.grad, dtype)
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


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no grouped_mm")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp32_lora_on_bf16"])
def test_grouped_path_equals_loop_path(precision: str) -> None:
    dtype, lora_dtype = PRECISIONS[precision]
    layer, _, _ = _layer(5, dtype, seed=3, lora_dtype=lora_dtype)
    ids = torch.randint(-1, 5, (4, 50), generator=torch.Generator().manual_seed(4))
    x = torch.randn(4, 50, IN).to(dtype)
    outs, grads = [], []
    for grouped in (False, True):
        layer.use_grouped_mm = grouped
        for p in layer.parameters():
            p.grad = None
        y = layer(x, ids)
        y.float().sum().backward()  # sum() hands back an expanded (stride 0) gradient: grouped_mm must cope
        outs.append(y)
        grads.append([p.grad.clone() for p in layer.parameters() if p.grad is not None])
    # The same maths in the same dtype: only summation order differs.
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(outs[1], outs[0], **tol)
    assert len(grads[0]) == len(grads[1]) == 10
    for loop_grad, grouped_grad in zip(*grads, strict=True):
        torch.testing.assert_close(
            grouped_grad, loop_grad, **{**tol, "atol": tol["atol"] * float(loop_grad.abs().max())}
        )


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
        other.load_adapter_state_dict(
            0, {"lora_A.weight": torch.zeros(MAX_RANK + 1, IN), "lora_B.weight": torch.zeros(OUT, MAX_RANK + 1)}
        )


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
    with pytest.raises(
        AdapterError, match=rf"lora_ranks\[1\] = {MAX_RANK + 1}: a run's rank must be in \[1, {MAX_RANK}\]"
    ):
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
    other = _tiny_llama()
    with pytest.raises(
        AdapterError, match=r"target_modules \['nope', 'q_prj'\] match no nn\.Linear or Conv1D"
    ) as error:
        apply_multi_lora(other, target_modules=("q_proj", "nope", "q_prj"), rank=4, n_adapters=2)
    available = "['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']"
    assert str(error.value).endswith(f"its layers are named {available}")
    assert all(p.requires_grad for p in other.parameters()), "a refused call leaves the model as it was"


def test_the_batch_plan_is_computed_once_per_model_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _tiny_llama()
    lora = apply_multi_lora(model, rank=4, n_adapters=3)
    assert len(lora.modules) == 14
    lora.lora_ranks.copy_(torch.tensor([4, 2, 3]))
    with torch.no_grad():
        for idx in range(3):
            for _, param in lora.named_parameters_for_adapter(idx):
                param.normal_(std=0.2)
    built: list[BatchPlan] = []
    reads: list[int] = []
    init, tolist = BatchPlan.__init__, Tensor.tolist

    def counting_init(self: BatchPlan, *args: object) -> None:
        built.append(self)
        init(self, *args)  # type: ignore[arg-type]

    def counting_tolist(self: Tensor) -> object:
        reads.append(self.numel())
        return tolist(self)

    monkeypatch.setattr(BatchPlan, "__init__", counting_init)
    tokens = torch.randint(0, 64, (4, 9))
    with lora.active_adapters(torch.tensor([2, -1, 1, 2])):
        monkeypatch.setattr(Tensor, "tolist", counting_tolist)
        first = model(tokens).logits
        monkeypatch.setattr(Tensor, "tolist", tolist)
        assert len(built) == 1 and built[0].present == [(1, 9), (2, 18)]
        # bincount, then scalings and ranks: three reads for the whole model, none per layer
        assert len(reads) == 3, reads
        again = model(tokens).logits
        assert len(built) == 1, "a second forward with the same ids reuses the plan"
        lora.scaling_factors[1] = 5.0  # an in-place change of the registry is seen
        changed = model(tokens).logits
    torch.testing.assert_close(again, first)
    assert not torch.allclose(changed[2], first[2]) and torch.equal(changed[0], first[0])
    with lora.active_adapters(torch.tensor([0, 0, 1, 2])):
        model(tokens)
    assert len(built) == 2, "new ids from active() make a new plan"
    assert lora.adapter_batch.ids is None and lora.adapter_batch._plan is None
