"""Per-token log-probabilities without the full logits (`rlplex.models.logprobs`): the fused path
gives what `model(...).logits` gives, values and gradients, with padding and temperatures, and a
model whose head is more than a linear map takes the plain path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lm_models import random_llama, untrained_tiny_model
from rlplex.models import logprobs
from rlplex.models.hf import load_causal_lm
from rlplex.models.spec import ModelSpec


def _model(path: Path) -> torch.nn.Module:
    model = load_causal_lm(ModelSpec(name=str(path)), torch.device("cpu")).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (5, 16), generator=torch.Generator().manual_seed(0))
    attention = torch.ones_like(tokens)
    attention[1, :4] = 0  # left padding, as the trainer's rows
    attention[3, :9] = 0
    return tokens, attention, torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5])


def _values_and_grads(
    model: torch.nn.Module, fused: bool, trained: torch.nn.Parameter, tempered: bool = True
) -> tuple[torch.Tensor, ...]:
    vocab = model.get_output_embeddings().weight.shape[0]
    tokens, attention, temperature = _batch(vocab)
    temperature = temperature if tempered else None  # type: ignore[assignment]
    trained.grad = None
    path = logprobs._fused if fused else logprobs._plain
    values = path(model, tokens, attention, temperature)
    weights = torch.randn(values.shape, generator=torch.Generator().manual_seed(1))
    (values * weights).sum().backward()
    assert trained.grad is not None
    return values.detach(), trained.grad.clone()


@pytest.mark.parametrize("build", [untrained_tiny_model, random_llama], ids=["qwen3", "llama"])
def test_the_fused_path_gives_the_logits_values_and_gradients(build: object) -> None:
    model = _model(build())  # type: ignore[operator]
    assert logprobs._fused_matches(model, *_batch(model.get_output_embeddings().weight.shape[0]))
    trained = next(m for m in model.modules() if isinstance(m, torch.nn.Linear)).weight
    trained.requires_grad_(True)  # a body weight, as a LoRA adapter is
    plain_values, plain_grad = _values_and_grads(model, False, trained)
    fused_values, fused_grad = _values_and_grads(model, True, trained)
    torch.testing.assert_close(fused_values, plain_values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_grad, plain_grad, rtol=1e-4, atol=1e-5)
    vocab = model.get_output_embeddings().weight.shape[0]
    _, attention, _ = _batch(vocab)
    real = torch.cat([torch.zeros_like(attention[:, :1]), attention[:, 1:]], dim=1).bool()  # targets
    assert (fused_values[~real] == 0).all() and (fused_values[real] < 0).all()


def test_chunks_and_a_trained_head_give_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(untrained_tiny_model())
    head = model.get_output_embeddings().weight
    head.requires_grad_(True)
    plain_values, plain_grad = _values_and_grads(model, False, head)
    monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", head.shape[0] * 7)  # 7 positions a chunk
    fused_values, fused_grad = _values_and_grads(model, True, head)
    torch.testing.assert_close(fused_values, plain_values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_grad, plain_grad, rtol=1e-4, atol=1e-5)
    # Without temperatures (the trainer's usual case) no scale is applied at all.
    untempered = [_values_and_grads(model, fused, head, tempered=False) for fused in (False, True)]
    torch.testing.assert_close(untempered[1][0], untempered[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(untempered[1][1], untempered[0][1], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(untempered[1][0], fused_values)  # the temperatures did change something


def test_a_head_that_does_more_than_project_takes_the_plain_path() -> None:
    model = _model(untrained_tiny_model())
    forward = model.forward

    def scaled_logits(*args: object, **kwargs: object) -> object:
        out = forward(*args, **kwargs)
        out.logits = out.logits * 2.0  # a logit scale, as some architectures have
        return out

    model.forward = scaled_logits  # type: ignore[method-assign]
    tokens, attention, temperature = _batch(model.get_output_embeddings().weight.shape[0])
    assert not logprobs._fused_matches(model, tokens, attention, temperature)
    with torch.no_grad():
        got = logprobs.token_logprobs(model, tokens, attention, temperature)
        want = logprobs._plain(model, tokens, attention, temperature)
    torch.testing.assert_close(got, want)


@pytest.mark.gpu
def test_under_bf16_autocast_on_a_gpu_the_fused_path_gives_the_plain_ones_gradients() -> None:
    """The trainer's CUDA step: a bf16 base under autocast (its backward recomputes the logits
    under the forward's autocast)."""
    model = _model(untrained_tiny_model()).to("cuda", torch.bfloat16)
    trained = next(m for m in model.modules() if isinstance(m, torch.nn.Linear)).weight
    trained.requires_grad_(True)
    results = []
    for path in (logprobs._plain, logprobs._fused):
        tokens, attention, temperature = (t.cuda() for t in _batch(model.get_output_embeddings().weight.shape[0]))
        trained.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            values = path(model, tokens, attention, temperature)
        values.sum().backward()
        assert trained.grad is not None
        results.append((values.detach().float(), trained.grad.float().clone()))
    (plain_values, plain_grad), (fused_values, fused_grad) = results
    torch.testing.assert_close(fused_values, plain_values, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused_grad, plain_grad, rtol=5e-2, atol=5e-2)
