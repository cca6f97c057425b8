"""Per-token log-probs (and entropy) of response tokens from packed hidden states.

:func:`response_logprobs` scores every response token of a :class:`dualkv.PackedBatch` from the
final hidden states of the packed stream and the LM head, and returns them in the rows'
``[B, R_max]`` layout (zeros on padding). The hidden state at a prompt's last position predicts
the first token of each of its N responses, so that row of the LM head is scored against N
labels. The vocabulary projection is chunked over tokens and recomputed in the backward pass: no
``[tokens x vocab]`` tensor exists for all tokens at once, and no float32 one at all: fused C++ /
CUDA kernels (``dualkv::logit_stats``, ``dualkv::logit_grad_``) read each chunk's logits in their
own dtype and write the gradient in place.

:func:`logprobs_from_logits` is the plain (unchunked) computation a trainer does on the rows'
logits; it is the reference the packed path is checked against.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from ._autocast import autocast_inputs
from ._ops import check_no_tangents, ops
from .packing import PackedBatch

__all__ = ["logprobs_from_logits", "response_logprobs"]

# Default chunk: about 512 MiB of logits (in the hidden states' dtype) per chunk of tokens. The
# chunk's logits are the only [tokens x vocab] tensor: the statistics are computed from them in
# one pass and the backward overwrites them with their gradient.
_CHUNK_BYTES = 1 << 29


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of 16/32-bit inputs (float32; float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


_wide_gemm_ok: bool | None = None  # whether torch's mm/addmm take out_dtype (torch >= 2.8)


def _matmul_into(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc += a @ b`` (or ``a @ b``) in ``acc``'s float32/float64 precision; returns ``acc``.

    On CUDA with 16-bit inputs one GEMM writes the float32 result into ``acc`` (beta = 1)
    instead of rounding the product to 16 bits first; on torch < 2.8 (no ``out_dtype``) the
    product is rounded to its dtype, then added. (Called only from the chunked log-prob ops'
    bodies, which run eagerly also under torch.compile.)
    """
    global _wide_gemm_ok
    wide = acc.dtype if acc is not None else _acc_dtype(a.dtype)
    if _wide_gemm_ok is not False and a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        try:
            if acc is None:
                out = torch.mm(a, b, out_dtype=wide)
            else:
                out = torch.addmm(acc, a, b, out_dtype=wide, out=acc)
        except TypeError:  # torch without out_dtype: fall back below from now on
            _wide_gemm_ok = False
        else:
            _wide_gemm_ok = True
            return out
    prod = (a @ b).to(wide)
    return prod if acc is None else acc.add_(prod)


# The chunked computation is a pair of custom ops (their Python bodies run eagerly, also under
# torch.compile): a compiled graph sees one opaque op per call with symbolic output sizes, so the
# per-chunk loop neither unrolls into the graph nor specialises it to one batch's token count.
def _stats_like(
    hidden: torch.Tensor, m: Any, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised (logp, lse, entropy) outputs for m scored tokens (entropy empty if unasked)."""
    acc = _acc_dtype(hidden.dtype)
    return (hidden.new_empty(m, dtype=acc), hidden.new_empty(m, dtype=acc),
            hidden.new_empty(m if entropy else 0, dtype=acc))  # fmt: skip


@torch.library.custom_op("dualkv::chunked_logprobs", mutates_args=())
def _chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    sources: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    softcap: float,
    chunk: int,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, lse, entropy) of labels under softmax(f(linear(hidden[sources]))), chunk by chunk.

    f applies the logit softcap and the temperature (include/dualkv/logits.h). Per chunk, the
    logits come from one GEMM in the hidden states' dtype and ``dualkv::logit_stats`` reads them
    once. ``entropy`` is empty unless asked for.
    """
    m = sources.numel()
    logp, lse, ent = _stats_like(hidden, m, entropy)
    for s in range(0, m, chunk):
        e = min(s + chunk, m)
        z = torch.nn.functional.linear(hidden.index_select(0, sources[s:e]), weight, bias)
        lp, lz, en = ops.logit_stats(z, labels[s:e], temperature, softcap, entropy)
        logp[s:e], lse[s:e] = lp, lz
        if entropy:
            ent[s:e] = en
    return logp, lse, ent


@_chunked_logprobs.register_fake
def _(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sources: torch.Tensor,
    labels: torch.Tensor, temperature: float, softcap: float, chunk: int, entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return _stats_like(hidden, sources.shape[0], entropy)


@torch.library.custom_op("dualkv::chunked_logprobs_backward", mutates_args=())
def _chunked_logprobs_backward(
    g_logp: torch.Tensor,
    g_ent: torch.Tensor | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    sources: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    ent: torch.Tensor,
    temperature: float,
    softcap: float,
    chunk: int,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of hidden, weight, bias (each empty where ``needs`` says it is not wanted).

    Recomputes each chunk's logits; ``dualkv::logit_grad_`` turns them into their gradient in
    place, which two GEMMs then project back to hidden and weight (accumulated in float32).
    """
    need_h, need_w, need_b = needs
    m = sources.numel()
    acc = lse.dtype
    grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
    grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
    for s in range(0, m, chunk):
        e = min(s + chunk, m)
        src = sources[s:e]
        h = hidden.index_select(0, src)
        gz = torch.nn.functional.linear(h, weight, bias)
        ops.logit_grad_(
            gz, labels[s:e], lse[s:e], g_logp[s:e],
            g_ent[s:e] if g_ent is not None else None,
            ent[s:e] if g_ent is not None else None,
            temperature, softcap,
        )  # fmt: skip
        if grad_h is not None:
            grad_h.index_add_(0, src, _matmul_into(None, gz, weight))
        if grad_w is not None:
            _matmul_into(grad_w, gz.t(), h)
        if grad_b is not None:
            grad_b += gz.sum(0, dtype=acc)
    return (  # (distinct empty tensors where not wanted: a custom op's outputs may not alias)
        grad_h.to(hidden.dtype) if grad_h is not None else hidden.new_empty(0),
        grad_w.to(weight.dtype) if grad_w is not None else hidden.new_empty(0),
        grad_b.to(weight.dtype) if grad_b is not None else hidden.new_empty(0),
    )


@_chunked_logprobs_backward.register_fake
def _(
    g_logp: torch.Tensor, g_ent: torch.Tensor | None, hidden: torch.Tensor, weight: torch.Tensor,
    bias: torch.Tensor | None, sources: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor,
    ent: torch.Tensor, temperature: float, softcap: float, chunk: int, needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return (
        torch.empty_like(hidden) if needs[0] else hidden.new_empty(0),
        torch.empty_like(weight) if needs[1] else hidden.new_empty(0),
        weight.new_empty(weight.shape[0]) if needs[2] else hidden.new_empty(0),
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    hidden, weight, bias, sources, labels, temperature, softcap, chunk, entropy = inputs
    _logp, lse, ent = output
    ctx.save_for_backward(hidden, weight, bias, sources, labels, lse, ent)
    ctx.cfg = (temperature, softcap, chunk, entropy)


def _backward(
    ctx: Any, g_logp: torch.Tensor | None, _g_lse: torch.Tensor | None, g_ent: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    hidden, weight, bias, sources, labels, lse, ent = ctx.saved_tensors
    temperature, softcap, chunk, entropy = ctx.cfg
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    needs = [bool(need_h), bool(need_w), bool(need_b and bias is not None)]
    if g_logp is None:
        g_logp = torch.zeros_like(lse)
    gh, gw, gb = _chunked_logprobs_backward(
        g_logp, g_ent if entropy else None, hidden, weight, bias, sources, labels, lse, ent,
        temperature, softcap, chunk, needs,
    )  # fmt: skip
    grads = [g if need else None for g, need in zip((gh, gw, gb), needs, strict=True)]
    return (*grads, None, None, None, None, None, None)


_chunked_logprobs.register_autograd(_backward, setup_context=_setup_context)


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
            logits (in the hidden states' dtype) near 512 MiB.

    Returns:
        ``logprobs`` ``[B, R_max]`` float32 (float64 for float64 inputs; zeros on padding), or
        ``(logprobs, entropy)``.
        Differentiable w.r.t. ``hidden_states``, ``lm_head_weight`` and ``lm_head_bias``; the
        backward recomputes each chunk's logits instead of storing them.
    """
    logp, ent = score_tokens(
        hidden_states, lm_head_weight, lm_head_bias, packed.token_sources, packed.token_labels,
        packed.total_tokens, temperature, logit_softcap, chunk_size, return_entropy,
    )  # fmt: skip
    out = packed.scatter_tokens(logp)
    return (out, packed.scatter_tokens(ent)) if return_entropy else out


def score_tokens(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None,
    sources: torch.Tensor,
    labels: torch.Tensor,
    num_tokens: int,
    temperature: float,
    logit_softcap: float | None,
    chunk_size: int | None,
    return_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp [M], entropy [M or 0])`` of ``labels`` predicted from the hidden states at
    ``sources``: the checked arguments and one call of the chunked op (shared by
    :func:`response_logprobs` and :func:`dualkv.parallel.response_logprobs`, whose
    ``num_tokens`` is the rank's shard)."""
    if hidden_states.dim() == 3:
        if hidden_states.shape[0] != 1:
            raise ValueError(
                f"hidden_states must be [1, T, H] or [T, H], got {tuple(hidden_states.shape)}"
            )
        hidden_states = hidden_states[0]
    if hidden_states.dim() != 2 or hidden_states.shape[0] != num_tokens:
        raise ValueError(
            f"hidden_states must have {num_tokens} packed tokens ([1, T, H] or [T, H]), "
            f"got {tuple(hidden_states.shape)}"
        )
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden_states.shape[1]:
        raise ValueError(
            f"lm_head_weight must be [V, {hidden_states.shape[1]}], "
            f"got {tuple(lm_head_weight.shape)}"
        )
    _check_temperature(temperature)
    if not torch.compiler.is_compiling():
        check_no_tangents("dualkv log-probs", hidden_states, lm_head_weight, lm_head_bias)
    per_token = max(lm_head_weight.shape[0], 1) * hidden_states.element_size()
    chunk = int(chunk_size) if chunk_size is not None else max(16, _CHUNK_BYTES // per_token)
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    # Under autocast the logits are computed in the dtype the rows' LM head would use (autocast's
    # rule: float64 stays float64); the op then runs with autocast off, so that its backward
    # (which may run after the autocast block has ended) recomputes the same logits its
    # forward's lse came from. Outside autocast, the LM head follows the hidden states' dtype.
    dev = hidden_states.device.type
    autocast = torch.is_autocast_enabled(dev)
    if autocast:
        hidden_states, weight = autocast_inputs(dev, hidden_states, lm_head_weight)
        bias = autocast_inputs(dev, lm_head_bias)[0] if lm_head_bias is not None else None
    else:
        dtype = hidden_states.dtype
        weight = lm_head_weight.to(dtype)
        bias = lm_head_bias.to(dtype) if lm_head_bias is not None else None
    with torch.autocast(dev, enabled=False) if autocast else contextlib.nullcontext():
        logp, _lse, ent = _chunked_logprobs(
            hidden_states, weight, bias, sources, labels,
            float(temperature), float(logit_softcap or 0.0), chunk, bool(return_entropy),
        )  # fmt: skip
    return logp, ent


def _check_temperature(temperature: float) -> None:
    """Both log-prob paths divide the logits by the temperature: it must be finite and > 0
    (traced by torch.compile, where it may be symbolic, as an assert in the graph)."""
    msg = "temperature must be finite and > 0"
    if torch.compiler.is_compiling():
        t = torch.scalar_tensor(temperature, dtype=torch.float64)
        torch._assert_async((t > 0) & torch.isfinite(t), msg)
    elif not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"{msg}, got {temperature}")


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
    _check_temperature(temperature)
    z = logits.to(_acc_dtype(logits.dtype))
    if mask is not None:  # a non-finite masked row would make log_softmax's gradient NaN there
        z = torch.where(mask.bool().unsqueeze(-1), z, 0.0)
    if temperature != 1.0:
        z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    if mask is not None:  # (a where, not a product: a non-finite masked value stays out)
        logp = torch.where(mask.bool(), logp, 0.0)
    if not return_entropy:
        return logp
    # p log p is 0 where p is 0 (a -inf logit; 0 * -inf would be NaN)
    ent = -(logp_all.exp() * torch.where(logp_all > -math.inf, logp_all, 0.0)).sum(-1)
    if mask is not None:
        ent = torch.where(mask.bool(), ent, 0.0)
    return logp, ent
