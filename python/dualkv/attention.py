"""dualkv.attention: exact attention over the shared-prompt layout."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from ._ops import NO_FUNCTORCH_MESSAGE, check_no_tangents, ops
from .layout import Layout, check_window


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Layout,
    softmax_scale: float | None = None,
    window: int | None = None,
    softcap: float | None = 0.0,
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
        softcap: if > 0, scores become ``softcap * tanh(score / softcap)``; 0 or None: none.
        return_lse: also return the log-sum-exp ``[Hq, T]`` (natural log; float32, or float64
            for float64 inputs).
        deterministic: make the backward pass bitwise reproducible (dq too; dk/dv always are).
            Also on under ``torch.use_deterministic_algorithms(True)`` (``warn_only`` too: this
            op has a deterministic algorithm, as PyTorch's ops with one pick it then).

    Returns:
        ``out`` ``[T, Hq, D]`` in q's dtype, or ``(out, lse)`` when ``return_lse``.

    Dtypes: bfloat16 and float16 everywhere; float32 and float64 on CPU.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a dualkv.Layout, got {type(layout).__name__}")
    if not torch.compiler.is_compiling():
        if torch._C._are_functorch_transforms_active():
            raise NotImplementedError(NO_FUNCTORCH_MESSAGE)
        check_no_tangents("dualkv.attention", q, k, v)
    if q.dim() != 3:
        raise ValueError(f"q must have shape [T, Hq, D], got {tuple(q.shape)}")
    if q.shape[-1] == 0:
        raise ValueError(f"head dim must be positive, got q of shape {tuple(q.shape)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else _real(softmax_scale)
    cap = 0.0 if softcap is None else _real(softcap, "softcap")
    out, lse = ops.fwd(
        q, k, v, layout.segments, layout.query_tiles, layout.key_tiles, layout.total_tokens,
        scale, check_window(window), cap,
        _flag(deterministic, "deterministic") or torch.are_deterministic_algorithms_enabled(),
    )  # fmt: skip
    return (out, lse) if _flag(return_lse, "return_lse") else out


def _real(value: Any, name: str = "softmax_scale") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # (an int or Fraction beyond float64; float() names no argument)
        raise ValueError(f"{name}={value} is outside float64's range") from None


def _flag(value: Any, name: str) -> bool:
    """A bool option (numpy bools too); strings such as "no" are refused, not read as True."""
    if (
        isinstance(value, bool)
        or type(value).__module__ == "numpy"
        and type(value).__name__ == "bool"
    ):
        return bool(value)
    raise TypeError(f"{name} must be True or False, got {value!r}")
