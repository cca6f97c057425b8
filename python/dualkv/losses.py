"""GRPO and DAPO token-level policy losses on the rows' ``[B, R_max]`` log-probs.

The losses take per-token log-probs in the trainer's row layout (what
:func:`dualkv.response_logprobs` returns), so they are the same numbers whether the log-probs came
from the packed shared-prompt forward or from the standard rows. Conventions follow veRL's
``compute_policy_loss`` / ``agg_loss``:

* ratio ``r = exp(logp - old_logp)`` (log-ratio clamped to [-20, 20]);
* clipped surrogate ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``, optionally the dual clip
  ``min(., -A c)`` for negative advantages;
* aggregation ``token-mean`` (DAPO), ``seq-mean-token-mean`` (GRPO), ``seq-mean-token-sum`` or
  ``seq-mean-token-sum-norm`` (Dr. GRPO); the ``seq-mean`` modes average over the rows that have
  a real token (veRL 0.9.1 leaves fully masked rows out).

These are veRL's conventions, not TRL's: TRL's ``GRPOTrainer`` (which
:class:`dualkv.integrations.trl.DualKVGRPOTrainer` runs with its own losses, unchanged) averages
``grpo`` over every row including fully masked ones, divides ``dr_grpo`` by
``B * max_completion_length`` (here ``seq-mean-token-sum-norm`` divides by the batch's response
width), does not clamp the log-ratio or the k3 KL, and standardises advantages with eps 1e-4
(a group of one gets 0 there, its raw reward here). Use TRL's own losses for TRL-identical
numbers.

The losses do not synchronise with the host: statistics are returned as detached tensors.
:func:`group_advantages` does (it numbers the group ids on the host).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from .trainer_rows import group_codes

__all__ = [
    "LOSS_AGG_MODES",
    "aggregate",
    "dapo_loss",
    "group_advantages",
    "grpo_loss",
    "policy_loss",
]

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    num_tokens: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Aggregate per-token values ``[B, R]`` over the real tokens (``mask``) to a scalar.

    Padding is selected out (``torch.where``), never multiplied by 0, so a NaN or inf on a padded
    position cannot reach the result or its gradient.

    Args:
        values: ``[B, R]`` per-token values.
        mask: ``[B, R]`` True (or 1) on real response tokens.
        mode: one of :data:`LOSS_AGG_MODES`.
        num_tokens: for ``token-mean``, an optional global token count (> 0) to divide by instead
            of this micro-batch's (for gradient accumulation over micro-batches).

    Returns:
        A 0-d tensor.
    """
    if values.shape != mask.shape:
        raise ValueError(
            f"values and mask must have one shape [B, R], got {tuple(values.shape)} and "
            f"{tuple(mask.shape)}"
        )
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")
    keep = mask != 0
    m = keep.to(values.dtype)
    masked = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if mode == "token-mean":
        if num_tokens is None:
            denom = m.sum().clamp(min=1)
        else:
            denom = _check_num_tokens(num_tokens).to(device=values.device, dtype=values.dtype)
        return masked.sum() / denom
    seq_sum = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = seq_sum / m.sum(-1).clamp(min=1)
    elif mode == "seq-mean-token-sum":
        per_seq = seq_sum
    else:  # seq-mean-token-sum-norm
        per_seq = seq_sum / max(values.shape[-1], 1)
    # the mean over the rows with a real token, as veRL's agg_loss (a fully masked row, e.g. an
    # empty response, is left out instead of counting as a zero loss)
    return per_seq.sum() / keep.any(-1).sum().clamp(min=1).to(values.dtype)


def _check_num_tokens(num_tokens: torch.Tensor | float) -> torch.Tensor:
    """num_tokens as a tensor, refused when it is not a positive count (no sync on the GPU)."""
    if isinstance(num_tokens, torch.Tensor):
        if num_tokens.numel() != 1:
            raise ValueError(f"num_tokens must be a scalar, got shape {tuple(num_tokens.shape)}")
        if num_tokens.device.type == "cpu" and not bool(num_tokens > 0):
            raise ValueError(f"num_tokens must be > 0, got {num_tokens.item()}")
        return num_tokens.reshape(())
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Real):
        raise TypeError(f"num_tokens must be a number or a tensor, got {num_tokens!r}")
    count = float(num_tokens)
    if not count > 0 or not math.isfinite(count):
        raise ValueError(f"num_tokens must be a positive, finite token count, got {num_tokens}")
    return torch.tensor(count)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    keep = mask != 0
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(keep, x, zero).sum() / keep.sum().clamp(min=1)


def _check_clip(name: str, value: float, upper: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (upper is not None and value >= upper):
        bound = f"in [0, {upper:g})" if upper is not None else ">= 0"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return float(value)


def _per_token(name: str, x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Advantages ``[B]``, ``[B, 1]`` or ``[B, R]`` as a ``[B, 1]`` / ``[B, R]`` tensor; any
    other shape is refused (e.g. ``[B, 1, 1]`` would broadcast to a different loss)."""
    if x.dim() == 1 and x.shape[0] == shape[0]:
        return x[:, None]
    if x.dim() == 2 and x.shape[0] == shape[0] and x.shape[1] in (1, shape[1]):
        return x
    raise ValueError(
        f"{name} must have shape [B], [B, 1] or [B, R] = {list(shape)} (one per response or per "
        f"token), got {tuple(x.shape)}"
    )


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    num_tokens: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped-ratio policy-gradient loss (PPO/GRPO/DAPO family) on rows' token log-probs.

    Args:
        logprobs: ``[B, R]`` current policy log-probs (differentiable).
        old_logprobs: ``[B, R]`` log-probs of the policy that sampled the responses.
        advantages: ``[B]`` / ``[B, 1]`` per-response or ``[B, R]`` per-token advantages
            (other shapes are refused).
        response_mask: ``[B, R]`` True on real response tokens.
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``
            (``0 <= clip_low < 1``, ``clip_high >= 0``).
        clip_ratio_c: dual-clip constant (> 1) for negative advantages, or None.
        loss_agg_mode: aggregation, one of :data:`LOSS_AGG_MODES`.
        ref_logprobs: ``[B, R]`` reference-policy log-probs for a KL penalty (k3 estimator).
        kl_coef: weight of the KL penalty (used when ``ref_logprobs`` is given).
        num_tokens: global token count for ``token-mean`` over several micro-batches.

    Returns:
        ``(loss, stats)``: a 0-d loss and detached 0-d statistics ``pg_loss``, ``clipfrac``,
        ``approx_kl`` (and ``kl`` with a reference and a nonzero ``kl_coef``).
    """
    if logprobs.shape != old_logprobs.shape or logprobs.shape != response_mask.shape:
        raise ValueError(
            "logprobs, old_logprobs and response_mask must have one shape [B, R], got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(response_mask.shape)}"
        )
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, R], got shape {tuple(logprobs.shape)}")
    if ref_logprobs is not None and ref_logprobs.shape != logprobs.shape:
        raise ValueError(
            f"ref_logprobs must have logprobs' shape {tuple(logprobs.shape)}, got "
            f"{tuple(ref_logprobs.shape)}"
        )
    clip_low = _check_clip("clip_low", clip_low, upper=1.0)
    clip_high = _check_clip("clip_high", clip_high)
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    if num_tokens is not None:
        _check_num_tokens(num_tokens)
    # Padding is selected out before any arithmetic: a NaN/inf on a padded position must not
    # reach the loss or (through 0 * NaN) its gradient.
    keep = response_mask != 0
    adv = _per_token("advantages", advantages, logprobs.shape).to(torch.float32)
    adv = torch.where(keep, adv, 0.0)
    logp = torch.where(keep, logprobs.float(), 0.0)
    old = torch.where(keep, old_logprobs.float(), 0.0)
    log_ratio = torch.clamp(logp - old, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    if clip_ratio_c is not None:
        clipped = torch.where(adv < 0, torch.minimum(clipped, -adv * clip_ratio_c), clipped)
    pg_loss = aggregate(clipped, response_mask, loss_agg_mode, num_tokens)
    loss = pg_loss
    stats: dict[str, Any] = {
        "pg_loss": pg_loss.detach(),
        "clipfrac": _masked_mean((loss2 > loss1).float(), response_mask).detach(),
        "approx_kl": _masked_mean(-log_ratio, response_mask).detach(),
    }
    if ref_logprobs is not None and kl_coef != 0.0:
        # k3 estimator (low variance, non-negative): exp(ref - logp) - (ref - logp) - 1
        ref = torch.where(keep, ref_logprobs.float(), 0.0)
        d = torch.clamp(ref - logp, min=-20.0, max=20.0)
        kl = torch.clamp(torch.exp(d) - d - 1.0, min=-10.0, max=10.0)
        kl_loss = aggregate(kl, response_mask, loss_agg_mode, num_tokens)
        loss = loss + kl_coef * kl_loss
        stats["kl"] = kl_loss.detach()
    return loss, stats


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_eps: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    loss_agg_mode: str = "seq-mean-token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss: symmetric clip ``eps``, per-sequence token mean, optional k3 KL to a reference.

    See :func:`policy_loss` for the arguments and the returned ``(loss, stats)``.
    """
    clip_eps = _check_clip("clip_eps", clip_eps, upper=1.0)
    return policy_loss(
        logprobs, old_logprobs, advantages, response_mask, clip_low=clip_eps, clip_high=clip_eps,
        loss_agg_mode=loss_agg_mode, ref_logprobs=ref_logprobs, kl_coef=kl_coef,
    )  # fmt: skip


def dapo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    loss_agg_mode: str = "token-mean",
    num_tokens: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DAPO loss: decoupled clip (clip-higher, ``eps_high`` = 0.28), token-level mean, no KL.

    See :func:`policy_loss` for the arguments and the returned ``(loss, stats)``.
    """
    return policy_loss(
        logprobs, old_logprobs, advantages, response_mask, clip_low=clip_low, clip_high=clip_high,
        loss_agg_mode=loss_agg_mode, num_tokens=num_tokens,
    )  # fmt: skip


def group_advantages(
    rewards: torch.Tensor,
    group_ids: Any,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO outcome advantages: each reward minus its group's mean (divided by the group's std).

    Args:
        rewards: ``[B]`` scalar reward per response.
        group_ids: ``[B]`` group of each response (as for :func:`dualkv.pack`).
        normalize_std: divide by the group's unbiased std + ``eps`` (False: Dr. GRPO).
        eps: added to the std.

    Returns:
        ``[B]`` float32 advantages; a singleton group gets ``reward`` (mean 0, std 1), as in veRL.
    """
    r = rewards.float().reshape(-1)
    codes = group_codes(group_ids, r.numel())  # on the host: the group count needs no sync
    groups = int(codes.max()) + 1 if r.numel() else 0
    codes = codes.to(r.device)
    count = torch.zeros(groups, device=r.device).index_add_(0, codes, torch.ones_like(r))
    mean = torch.zeros(groups, device=r.device).index_add_(0, codes, r) / count.clamp(min=1)
    dev = r - mean[codes]
    var = torch.zeros(groups, device=r.device).index_add_(0, codes, dev * dev)
    std = torch.sqrt(var / (count - 1).clamp(min=1))
    single = count[codes] <= 1
    adv = torch.where(single, r, dev)
    if normalize_std:
        adv = torch.where(single, adv, adv / (std[codes] + eps))
    return adv
