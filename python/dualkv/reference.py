"""The unshared reference: causal attention over the N rows [prompt | response_i] of each group,
in plain PyTorch (what a trainer computes without DualKV). Differentiable; it gathers from the
packed tensors, so autograd sums the prompt's gradients over rows exactly as the packed layout
must. Used by the tests and the demo as the oracle; slow, for checking only."""

from __future__ import annotations

import random

import torch


def random_layout_lens(
    rng: random.Random,
    groups: int = 3,
    max_p: int = 160,
    max_n: int = 4,
    max_r: int = 90,
    edge: bool = True,
) -> tuple[list[int], list[list[int]]]:
    """Random group lengths; with ``edge`` many P/R are 0 or 1."""

    def length(hi: int) -> int:
        if edge and rng.random() < 0.3:
            return rng.choice([0, 1])
        return rng.randint(0, hi)

    prefix = [length(max_p) for _ in range(groups)]
    resp = [[length(max_r) for _ in range(rng.randint(0, max_n))] for _ in range(groups)]
    return prefix, resp


def _row_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of one row: q [L, Hq, D], k/v [L, Hkv, D] -> out [L, Hq, D], lse [Hq, L]."""
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    diff = pos[:, None] - pos[None, :]
    allowed = diff >= 0
    if window is not None:
        allowed = allowed & (diff < window)
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s.float() if s.dtype != torch.float64 else s, dim=-1)
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v), lse


def unshared_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_lens: list[int],
    response_lens: list[list[int]],
    scale: float,
    window: int | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs each group's rows [prompt | r_i] separately and scatters back to packed order.

    Prompt outputs come from the prompt's own causal row (identical in every row). ``scale``,
    ``window`` and ``softcap`` (0: none) as in :func:`dualkv.attention`, the scale given
    explicitly. Returns ``(out [T, Hq, D], lse [Hq, T])`` (lse float32, or float64 for float64
    inputs)."""
    T = q.shape[0]
    out = q.new_zeros(q.shape)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.full((q.shape[1], T), float("-inf"), dtype=lse_dtype, device=q.device)
    pieces_o, pieces_l, index = [], [], []
    start = 0
    for P, rs in zip(prefix_lens, response_lens):
        prompt = torch.arange(start, start + P, device=q.device)
        if P > 0:
            o, lse_row = _row_attention(
                q[prompt],
                k[prompt],
                v[prompt],
                torch.arange(P, device=q.device),
                scale,
                window,
                softcap,
            )
            pieces_o.append(o)
            pieces_l.append(lse_row)
            index.append(prompt)
        cur = start + P
        for R in rs:
            resp = torch.arange(cur, cur + R, device=q.device)
            row = torch.cat([prompt, resp])
            if R > 0:
                o, lse_row = _row_attention(
                    q[row],
                    k[row],
                    v[row],
                    torch.arange(P + R, device=q.device),
                    scale,
                    window,
                    softcap,
                )
                pieces_o.append(o[P:])
                pieces_l.append(lse_row[:, P:])
                index.append(resp)
            cur += R
        start = cur
    if index:
        idx = torch.cat(index)
        out = out.index_copy(0, idx, torch.cat(pieces_o))
        lse = lse.index_copy(1, idx, torch.cat(pieces_l, dim=1).to(lse.dtype))
    return out, lse
