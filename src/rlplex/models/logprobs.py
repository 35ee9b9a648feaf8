"""Per-token log-probabilities of a causal LM without its [rows, tokens, vocabulary] logits in memory.

`model(...).logits` holds a float for every row, position and vocabulary entry, then
`log_softmax` another such tensor, and autograd keeps them for the backward pass: SmolLM2-135M
(49,152 entries) at 8,192 tokens is 1.6 GB each, ten times its weights. What a policy-gradient
loss needs is one number per token, log p(token_t | tokens_<t). So the model's body runs as
usual, and its output projection (`lm_head`) is applied a chunk of positions at a time inside
one autograd function that keeps only each position's log-normaliser, recomputing a chunk's
logits in the backward pass (the projection is frozen: only the hidden states get a gradient,
unless it is trained). Positions whose target is padding are not projected at all.

The split into body and head is the one every Hugging Face causal LM makes
(`get_decoder()`, `get_output_embeddings()`), but some heads do more than a linear map (a logit
scale, soft-capping): the first call on a model (and head) checks the split against
`model(...).logits` on its input's last few positions, and a model that differs (or has no such
split) takes the plain path.
"""

from __future__ import annotations

from typing import Any, cast

import torch

_CHUNK_ELEMENTS = 1 << 25  # logits per chunk: 128 MB of float32, whatever the vocabulary
_VERDICT = "_rlplex_fused_logprobs"  # a model's attribute: (its head, whether the split matched its logits)
_PROBE_POSITIONS = 8


def positions_of(attention_B_L: torch.Tensor) -> torch.Tensor:
    """Position ids of left-padded rows: 0 at each row's first real token."""
    return (attention_B_L.cumsum(-1) - 1).clamp(min=0)


def token_logprobs(
    model: torch.nn.Module,
    tokens_B_L: torch.Tensor,
    attention_B_L: torch.Tensor,
    temperature_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """log p(token_t | tokens_<t) for every position t >= 1 whose token is real (padding and
    position 0 get 0); differentiable.

    `temperature_B`: each row's sampling temperature, scaling the logits exactly as `generate`
    does, so that importance ratios compare the same distribution that sampled the tokens.
    """
    if _fused_matches(model, tokens_B_L, attention_B_L, temperature_B):
        return _fused(model, tokens_B_L, attention_B_L, temperature_B)
    return _plain(model, tokens_B_L, attention_B_L, temperature_B)


def _plain(
    model: torch.nn.Module, tokens_B_L: torch.Tensor, attention_B_L: torch.Tensor, temperature_B: torch.Tensor | None
) -> torch.Tensor:
    logits = model(input_ids=tokens_B_L, attention_mask=attention_B_L, position_ids=positions_of(attention_B_L)).logits
    logits = logits.float()
    if temperature_B is not None:
        logits = logits / temperature_B.to(logits.device, logits.dtype).clamp_min(1e-6)[:, None, None]
    log_p = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens_B_L[:, 1:, None]).squeeze(-1)
    log_p = log_p * attention_B_L[:, 1:].to(log_p.dtype)  # padding's values are noise: the same zeros as the fused path
    return torch.cat([torch.zeros_like(log_p[:, :1]), log_p], dim=1)


def _fused(
    model: torch.nn.Module, tokens_B_L: torch.Tensor, attention_B_L: torch.Tensor, temperature_B: torch.Tensor | None
) -> torch.Tensor:
    body, head = _body_and_head(model)
    assert head is not None  # _fused_matches checked it
    hidden = body(
        input_ids=tokens_B_L, attention_mask=attention_B_L, position_ids=positions_of(attention_B_L)
    ).last_hidden_state
    real = torch.cat([torch.zeros_like(attention_B_L[:, :1]), attention_B_L[:, 1:]], dim=1).bool()
    scale_N = None  # a scale of 1 would cost a pass over every chunk's logits for nothing
    if temperature_B is not None:
        inverse = temperature_B.to(hidden.device, torch.float32).clamp_min(1e-6).reciprocal()
        scale_N = inverse[:, None].expand(-1, real.shape[1] - 1)[real[:, 1:]]
    # Position t's target is token t + 1: the hidden states of the positions before each real target.
    log_p = _ProjectedLogProb.apply(hidden[:, :-1][real[:, 1:]], head.weight, tokens_B_L[real], scale_N)
    return torch.zeros(real.shape, dtype=torch.float32, device=hidden.device).masked_scatter(real, log_p)


class _ProjectedLogProb(torch.autograd.Function):
    """log_softmax(s * h W^T)[target] per row of `hidden_N_H` (`s`: its inverse temperature), a
    chunk of rows at a time; the logits are float32 after the projection in the model's dtype,
    as `model(...).logits.float()` are."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(
        ctx: Any,
        hidden_N_H: torch.Tensor,
        weight_V_H: torch.Tensor,
        target_N: torch.Tensor,
        scale_N: torch.Tensor | None,
    ) -> torch.Tensor:
        chunk = max(1, _CHUNK_ELEMENTS // weight_V_H.shape[0])
        n = hidden_N_H.shape[0]
        log_norm = torch.empty(n, dtype=torch.float32, device=hidden_N_H.device)
        out = torch.empty(n, dtype=torch.float32, device=hidden_N_H.device)
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            logits = _chunk_logits(hidden_N_H, weight_V_H, scale_N, rows)
            log_norm[rows] = torch.logsumexp(logits, dim=-1)
            out[rows] = logits.gather(1, target_N[rows, None]).squeeze(1) - log_norm[rows]
        ctx.save_for_backward(hidden_N_H, weight_V_H, target_N, log_norm)
        ctx.scale_N, ctx.chunk = scale_N, chunk  # never a gradient's target: kept as it is
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")  # the recomputed logits as the forward's: under its autocast
    def backward(ctx: Any, grad_N: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden_N_H, weight_V_H, target_N, log_norm = ctx.saved_tensors
        scale_N = ctx.scale_N
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden_N_H) if want_hidden else None
        grad_weight = torch.zeros_like(weight_V_H, dtype=torch.float32) if want_weight else None
        for start in range(0, hidden_N_H.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            logits = _chunk_logits(hidden_N_H, weight_V_H, scale_N, rows)
            # d/dlogits of (logit[target] - logsumexp) = onehot(target) - softmax, times the incoming gradient.
            grad_logits = torch.exp(logits.sub_(log_norm[rows, None])).mul_(-grad_N[rows, None])
            grad_logits.scatter_add_(1, target_N[rows, None], grad_N[rows, None])
            if scale_N is not None:
                grad_logits.mul_(scale_N[rows, None])  # through the scale
            grad_logits = grad_logits.to(hidden_N_H.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight_V_H
            if grad_weight is not None:
                grad_weight += (grad_logits.T @ hidden_N_H[rows]).float()
        weight_grad = None if grad_weight is None else grad_weight.to(weight_V_H.dtype)
        return grad_hidden, weight_grad, None, None


def _chunk_logits(
    hidden_N_H: torch.Tensor, weight_V_H: torch.Tensor, scale_N: torch.Tensor | None, rows: slice
) -> torch.Tensor:
    logits = (hidden_N_H[rows] @ weight_V_H.T).float()  # the model's dtype, then float32: as `.logits.float()`
    return logits if scale_N is None else logits.mul_(scale_N[rows, None])


def _body_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear | None]:
    get_decoder, get_head = getattr(model, "get_decoder", None), getattr(model, "get_output_embeddings", None)
    if not callable(get_decoder) or not callable(get_head):
        return model, None
    body, head = get_decoder(), get_head()
    if body is None or body is model or type(head) is not torch.nn.Linear or head.bias is not None:
        return model, None
    return cast(torch.nn.Module, body), head


@torch.no_grad()
def _fused_matches(
    model: torch.nn.Module,
    tokens_B_L: torch.Tensor,
    attention_B_L: torch.Tensor,
    temperature_B: torch.Tensor | None,
) -> bool:
    """Whether the body-and-head split gives this model's log-probabilities, checked once per
    model and head on the last few positions of the first input (every row: a multi-LoRA model
    takes one adapter id per row)."""
    head = _body_and_head(model)[1]
    seen = getattr(model, _VERDICT, None)
    if seen is not None and seen[0] is head:
        return bool(seen[1])
    matches = False
    if head is not None:
        tokens, attention = tokens_B_L[:, -_PROBE_POSITIONS:], attention_B_L[:, -_PROBE_POSITIONS:]
        try:
            fused = _fused(model, tokens, attention, temperature_B)
            plain = _plain(model, tokens, attention, temperature_B)
            matches = bool(torch.allclose(fused, plain, rtol=1e-3, atol=1e-3))
        except (TypeError, ValueError, AttributeError):  # a body that takes other arguments
            matches = False
    setattr(model, _VERDICT, (head, matches))
    return matches
