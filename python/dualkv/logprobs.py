"""Per-token log-probs (and entropy) of response tokens from packed hidden states.

:func:`response_logprobs` scores every response token of a :class:`dualkv.PackedBatch` from the
final hidden states of the packed stream and the LM head, and returns them in the rows'
``[B, R_max]`` layout (zeros on padding). The hidden state at a prompt's last position predicts
the first token of each of its N responses, so that row of the LM head is scored against N
labels. The vocabulary projection is chunked over tokens and recomputed in the backward pass: no
float32 ``[tokens x vocab]`` tensor exists for all tokens at once.

:func:`logprobs_from_logits` is the plain (unchunked) computation a trainer does on the rows'
logits; it is the reference the packed path is checked against.
"""

from __future__ import annotations

from typing import Any

import torch

from .packing import PackedBatch

__all__ = ["logprobs_from_logits", "response_logprobs"]

# Default chunk: about 2**27 float32 logits (512 MiB) per chunk of tokens.
_CHUNK_ELEMENTS = 1 << 27


def _logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    softcap: float,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 (float64) logits of a chunk after softcap and temperature, and the capped ones."""
    z = torch.nn.functional.linear(h, weight, bias)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    capped = None
    if softcap > 0:
        z = torch.tanh(z / softcap) * softcap
        capped = z
    if temperature != 1.0:
        z = z / temperature
    return z, capped


class _ChunkedLogprobs(torch.autograd.Function):
    """Chunked log-prob/entropy of labels under softmax(linear(hidden[sources]) / temperature)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        sources: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        softcap: float,
        chunk: int,
        want_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = sources.numel()
        dev = hidden.device
        acc = torch.promote_types(hidden.dtype, torch.float32)
        logp = torch.empty(m, dtype=acc, device=dev)
        lse = torch.empty(m, dtype=acc, device=dev)
        ent = torch.empty(m if want_entropy else 0, dtype=acc, device=dev)
        for s in range(0, m, chunk):
            e = min(s + chunk, m)
            z, _ = _logits(hidden.index_select(0, sources[s:e]), weight, bias, softcap, temperature)
            lz = torch.logsumexp(z, dim=-1)
            lse[s:e] = lz
            logp[s:e] = z.gather(1, labels[s:e, None]).squeeze(1) - lz
            if want_entropy:
                p = torch.exp(z - lz[:, None])
                ent[s:e] = lz - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, sources, labels, lse, ent)
        ctx.cfg = (temperature, softcap, chunk, want_entropy, bias is not None)
        if not want_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, sources, labels, lse, ent = ctx.saved_tensors
        temperature, softcap, chunk, want_entropy, has_bias = ctx.cfg
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        m = sources.numel()
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        use_ent = want_entropy and g_ent is not None
        grad_h = (
            torch.zeros(hidden.shape, dtype=lse.dtype, device=hidden.device) if need_h else None
        )
        grad_w = (
            torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) if need_w else None
        )
        grad_b = (
            torch.zeros(weight.shape[0], dtype=lse.dtype, device=weight.device)
            if need_b and has_bias
            else None
        )
        for s in range(0, m, chunk):
            e = min(s + chunk, m)
            src = sources[s:e]
            h = hidden.index_select(0, src)
            z, capped = _logits(h, weight, bias, softcap, temperature)
            lz = lse[s:e, None]
            p = torch.exp(z - lz)
            # d logp / dz = onehot(label) - p ; d entropy / dz = -p (z - E_p[z]), E_p[z] = lse - H
            gz = p * (-g_logp[s:e, None])
            if use_ent:
                ez = lz - ent[s:e, None]
                gz -= g_ent[s:e, None] * p * (z - ez)
            gz.scatter_add_(1, labels[s:e, None], g_logp[s:e, None])
            if temperature != 1.0:
                gz /= temperature
            if capped is not None:
                gz *= 1.0 - (capped / softcap) ** 2
            gzc = gz.to(weight.dtype)
            if grad_h is not None:
                grad_h.index_add_(0, src, (gzc @ weight).to(lse.dtype))
            if grad_w is not None:
                grad_w += (gzc.t() @ h).to(lse.dtype)
            if grad_b is not None:
                grad_b += gz.sum(0)
        return (
            grad_h.to(hidden.dtype) if grad_h is not None else None,
            grad_w.to(weight.dtype) if grad_w is not None else None,
            grad_b.to(bias.dtype) if grad_b is not None else None,
            None, None, None, None, None, None,
        )  # fmt: skip


def response_logprobs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    packed: PackedBatch,
    temperature: float = 1.0,
    return_entropy: bool = False,
    lm_head_bias: torch.Tensor | None = None,
    logit_softcap: float | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of every response token from the packed final hidden states, in rows' layout.

    Args:
        hidden_states: ``[1, T, H]`` or ``[T, H]`` final hidden states of the packed stream (after
            the model's last norm).
        lm_head_weight: ``[V, H]`` output projection (``model.get_output_embeddings().weight``).
        packed: the :class:`dualkv.PackedBatch` the hidden states were computed from.
        temperature: logits are divided by it (as the sampler did).
        return_entropy: also return the entropy of each token's predictive distribution.
        lm_head_bias: optional ``[V]`` bias of the output projection.
        logit_softcap: final logit soft-capping ``c * tanh(logits / c)`` before the temperature
            (Gemma's ``final_logit_softcapping``); None or 0 for none.
        chunk_size: tokens per chunk of the vocabulary projection; default keeps one chunk's
            float32 logits near 512 MiB.

    Returns:
        ``logprobs`` ``[B, R_max]`` float32 (float64 for float64 inputs; zeros on padding), or
        ``(logprobs, entropy)``.
        Differentiable w.r.t. ``hidden_states``, ``lm_head_weight`` and ``lm_head_bias``; the
        backward recomputes each chunk's logits instead of storing them.
    """
    if hidden_states.dim() == 3:
        if hidden_states.shape[0] != 1:
            raise ValueError(
                f"hidden_states must be [1, T, H] or [T, H], got {tuple(hidden_states.shape)}"
            )
        hidden_states = hidden_states[0]
    if hidden_states.dim() != 2 or hidden_states.shape[0] != packed.total_tokens:
        raise ValueError(
            f"hidden_states must have {packed.total_tokens} packed tokens ([1, T, H] or [T, H]), "
            f"got {tuple(hidden_states.shape)}"
        )
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden_states.shape[1]:
        raise ValueError(
            f"lm_head_weight must be [V, {hidden_states.shape[1]}], "
            f"got {tuple(lm_head_weight.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab = lm_head_weight.shape[0]
    chunk = int(chunk_size) if chunk_size is not None else max(16, _CHUNK_ELEMENTS // max(vocab, 1))
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    weight = lm_head_weight
    if weight.dtype != hidden_states.dtype:
        weight = weight.to(hidden_states.dtype)
    bias = lm_head_bias.to(hidden_states.dtype) if lm_head_bias is not None else None
    logp, ent = _ChunkedLogprobs.apply(
        hidden_states,
        weight,
        bias,
        packed.token_sources,
        packed.token_labels,
        float(temperature),
        float(logit_softcap or 0.0),
        chunk,
        bool(return_entropy),
    )
    shape = (packed.num_rows, packed.max_response_len)
    flat = packed.token_rows
    out = logp.new_zeros(shape[0] * shape[1]).index_copy(0, flat, logp).view(shape)
    if not return_entropy:
        return out
    ent_rows = ent.new_zeros(shape[0] * shape[1]).index_copy(0, flat, ent).view(shape)
    return out, ent_rows


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Unchunked log-probs of ``labels`` under ``logits`` (the standard rows' computation).

    Args:
        logits: ``[..., V]`` logits where position ``i`` predicts ``labels[..., i]``.
        labels: ``[...]`` token ids.
        mask: optional ``[...]`` bool; outputs are zero where False.
        temperature: logits are divided by it.
        return_entropy: also return the entropy.

    Returns:
        float32 (float64 for float64 logits) ``logprobs`` (and ``entropy``) of the labels' shape.
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    if mask is not None:
        logp = logp * mask.to(logp.dtype)
    if not return_entropy:
        return logp
    ent = -(logp_all.exp() * logp_all).sum(-1)
    if mask is not None:
        ent = ent * mask.to(ent.dtype)
    return logp, ent
