"""Trainer rows (veRL layout: a left-padded prompt of width ``prompt_width``, then a right-padded
response) as the packers read them: their checks and lengths (:func:`checked_row_lengths`) and
their group codes (:func:`group_codes`, :func:`prompt_group_codes`). Host work, once per batch."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch


def group_codes(group_ids: Any, num_rows: int) -> torch.Tensor:
    """Group ids (tensor, array or sequence of hashables) -> int64 codes in first-seen order."""
    if isinstance(group_ids, torch.Tensor):
        g = group_ids.detach().to("cpu").reshape(-1)
        if g.numel() != num_rows:
            raise ValueError(f"group_ids must have one id per row ({num_rows}), got {g.numel()}")
        if g.is_floating_point() or g.is_complex():
            raise TypeError(f"group_ids must be an integer tensor, got {g.dtype}")
        _, inverse = torch.unique(g, return_inverse=True)
        first = torch.full(
            (int(inverse.max()) + 1 if num_rows else 0,), num_rows, dtype=torch.int64
        )
        first.scatter_reduce_(0, inverse, torch.arange(num_rows), reduce="amin")
        rank = torch.empty_like(first)
        rank[torch.argsort(first)] = torch.arange(first.numel())
        return rank[inverse]
    if hasattr(group_ids, "tolist") and not isinstance(group_ids, (list, tuple)):
        group_ids = group_ids.tolist()  # numpy arrays (e.g. veRL's uid strings)
    if isinstance(group_ids, (str, bytes)) or not isinstance(group_ids, Sequence):
        raise TypeError(
            f"group_ids must be a tensor or a sequence of ids, got {type(group_ids).__name__}"
        )
    if len(group_ids) != num_rows:
        raise ValueError(f"group_ids must have one id per row ({num_rows}), got {len(group_ids)}")
    seen: dict[Any, int] = {}
    codes = [seen.setdefault(_id_key(gid, b), len(seen)) for b, gid in enumerate(group_ids)]
    return torch.tensor(codes, dtype=torch.int64)


def _id_key(gid: Any, row: int) -> Any:
    """A group id as a dict key: a tensor element (``list(ids_tensor)``) by its value, since
    tensors hash by identity (every row would be a group of its own)."""
    if isinstance(gid, torch.Tensor):
        if gid.numel() != 1:
            raise ValueError(
                f"group_ids[{row}] must be one id, got a tensor of shape {tuple(gid.shape)}"
            )
        return gid.item()
    return gid


def prompt_group_codes(
    input_ids: torch.Tensor, prompt_mask: torch.Tensor, position_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Group codes (first-seen order) of rows whose real prompt tokens (and, when given, their
    position ids) are identical."""
    num_rows, pw = input_ids.shape[0], prompt_mask.shape[1]
    if pw == 0 or num_rows == 0:
        return torch.zeros(num_rows, dtype=torch.int64)
    # Prompts are right-aligned, so equal prompts are equal rows once padding is blanked out.
    real = prompt_mask.to(input_ids.device)
    key = torch.where(real, input_ids[:, :pw].to(torch.int64), -1)
    if position_ids is not None:  # (the token part already tells padding from real tokens)
        pos = torch.where(real, position_ids[:, :pw].to(input_ids.device, torch.int64), 0)
        key = torch.cat([key, pos], 1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    return group_codes(inverse, num_rows)


def checked_row_lengths(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    position_ids: torch.Tensor | None,
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks trainer rows (veRL layout) and reads their lengths on the host: ``(prompt_width,
    prompt mask [B, pw], prompt lengths [B], response lengths [B])``."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, L], got shape {tuple(input_ids.shape)}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
            f"got {tuple(attention_mask.shape)}"
        )
    if position_ids is not None and position_ids.shape != input_ids.shape:
        raise ValueError(
            f"position_ids must have the shape of input_ids {tuple(input_ids.shape)}, "
            f"got {tuple(position_ids.shape)}"
        )
    num_rows, width = input_ids.shape
    if isinstance(prompt_width, bool) or not isinstance(prompt_width, numbers.Integral):
        raise TypeError(f"prompt_width must be an int (a column count), got {prompt_width!r}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be an integer tensor of token ids, got {input_ids.dtype}")
    pw = int(prompt_width)
    if not 0 <= pw <= width:
        raise ValueError(f"prompt_width must be in [0, {width}], got {prompt_width}")
    rw = width - pw

    # --- lengths and mask shape (host, once per batch) -----------------------------------------
    mask = attention_mask.detach().to("cpu") != 0
    pmask, rmask = mask[:, :pw], mask[:, pw:]
    plen, rlen = pmask.sum(1), rmask.sum(1)
    cols_p, cols_r = torch.arange(pw), torch.arange(rw)
    bad_p = (pmask != (cols_p[None, :] >= (pw - plen)[:, None])).any(1)
    bad_r = (rmask != (cols_r[None, :] < rlen[:, None])).any(1)
    if bool(bad_p.any()):
        rows = bad_p.nonzero().flatten()[:8].tolist()
        raise ValueError(
            f"attention_mask: the prompt part (columns [0, {pw})) of rows {rows} is not "
            "left-padded "
            "(real prompt tokens must be contiguous and end at prompt_width)"
        )
    if bool(bad_r.any()):
        rows = bad_r.nonzero().flatten()[:8].tolist()
        raise ValueError(
            f"attention_mask: the response part (columns [{pw}, {width})) of rows {rows} is not "
            "right-padded (real response tokens must be contiguous and start at prompt_width)"
        )
    return pw, pmask, plen, rlen
