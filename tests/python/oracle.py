"""An attention oracle independent of the package: a dense [T, T] mask over the packed tokens,
written straight from DESIGN.md's rule (nothing from dualkv is used to build it)."""

from __future__ import annotations

import torch


def packed_mask(
    prefix: list[int], responses: list[list[int]], window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(allowed [T, T] bool, positions [T] int64)`` of a layout.

    Query q may attend to key k iff both are in one group and (k in the prompt and (q in the
    prompt with pos(k) <= pos(q), or q in a response), or k and q in one response with
    pos(k) <= pos(q)); with a window also pos(q) - pos(k) < window. Prompt token j has position
    j, token j of a response P + j.
    """
    group, segment, in_prompt, pos = [], [], [], []
    seg = 0
    for g, (p, rs) in enumerate(zip(prefix, responses, strict=True)):
        for j in range(p):
            group.append(g), segment.append(seg), in_prompt.append(True), pos.append(j)
        seg += 1
        for r in rs:
            for j in range(r):
                group.append(g), segment.append(seg), in_prompt.append(False), pos.append(p + j)
            seg += 1
    g_, s_, pr_, p_ = (torch.tensor(x, dtype=torch.int64) for x in (group, segment, in_prompt, pos))
    pr_ = pr_.bool()
    same_group = g_[:, None] == g_[None, :]
    causal = p_[None, :] <= p_[:, None]
    key_prompt, query_prompt = pr_[None, :], pr_[:, None]
    same_response = (s_[:, None] == s_[None, :]) & ~query_prompt
    allowed = same_group & (
        (key_prompt & query_prompt & causal)
        | (key_prompt & ~query_prompt)
        | (same_response & causal)
    )
    if window is not None:
        allowed &= (p_[:, None] - p_[None, :]) < window
    return allowed, p_


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: list[int],
    responses: list[list[int]],
    scale: float,
    window: int | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, Hq, D], lse [Hq, T])`` by a dense masked softmax in q's dtype (lse in float32,
    float64 for float64 inputs). Differentiable; a query with no key gets 0 and lse -inf."""
    T, hq, _ = q.shape
    hkv = k.shape[1]
    allowed, _ = packed_mask(prefix, responses, window)
    allowed = allowed.to(q.device)
    kk = k.repeat_interleave(hq // hkv, dim=1) if hkv else k
    vv = v.repeat_interleave(hq // hkv, dim=1) if hkv else v
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed[None], float("-inf"))
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.logsumexp(s.to(acc), dim=-1)  # [Hq, T]
    p = torch.exp(s.to(acc) - lse[..., None]).masked_fill(~allowed[None], 0.0).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", p.to(q.dtype), vv)
    return out, lse
