"""dualkv.attention: exact attention over the shared-prompt layout."""

from __future__ import annotations

import math

import torch

from ._ops import ops
from .layout import Layout


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Layout,
    softmax_scale: float | None = None,
    window: int | None = None,
    softcap: float = 0.0,
    return_lse: bool = False,
    deterministic: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over the packed shared-prompt layout, differentiable.

    Equal to causal attention over the N unshared rows ``[prompt | response_i]`` of every group:
    a prompt token attends causally within its prompt; a response token attends to the whole
    prompt and causally within its own response.

    Args:
        q: ``[T, Hq, D]`` queries in packed order (T = ``layout.total_tokens``).
        k, v: ``[T, Hkv, D]`` keys and values; ``Hq`` must be a multiple of ``Hkv`` (GQA/MQA).
        layout: the :class:`dualkv.Layout`, on the device of q/k/v.
        softmax_scale: score scale, default ``1/sqrt(D)``.
        window: sliding window in logical positions (a key is visible when
            ``pos(q) - pos(k) < window``), or None for none.
        softcap: if > 0, scores become ``softcap * tanh(score / softcap)``.
        return_lse: also return the log-sum-exp ``[Hq, T]`` (natural log; float32, or float64
            for float64 inputs).
        deterministic: make the backward pass bitwise reproducible (dq too; dk/dv always are).

    Returns:
        ``out`` ``[T, Hq, D]`` in q's dtype, or ``(out, lse)`` when ``return_lse``.

    Dtypes: bfloat16 and float16 everywhere; float32 and float64 on CPU.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a dualkv.Layout, got {type(layout).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must have shape [T, Hq, D], got {tuple(q.shape)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, lse = ops.fwd(
        q, k, v, layout.segments, layout.query_tiles, layout.key_tiles, layout.total_tokens,
        scale, window, float(softcap), bool(deterministic),
    )  # fmt: skip
    return (out, lse) if return_lse else out
