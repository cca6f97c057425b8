"""Packing trainer batches into the shared-prompt layout: :func:`dualkv.pack`.

A trainer batch holds one row per response (veRL layout: a left-padded prompt of width
``prompt_width`` followed by a right-padded response) and a group id per row; rows with the same
group id share one prompt. :func:`pack` turns it into one packed stream
``[prompt_1 | r_11 | ... | r_1N | prompt_2 | ...]`` of ``T = sum(P_g + sum_i R_gi)`` tokens, its
position ids (prompt ``0..P-1``, each response ``P..P+R_i-1``), the :class:`dualkv.Layout`, and
the index maps that take per-token results back to the rows' ``[B, R_max]`` response layout.

Packing is host work done once per batch (a few vectorised tensor operations and one
synchronisation to read the lengths); nothing here runs per layer or per token in Python.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .layout import Layout, mark_per_batch

__all__ = ["PackedBatch", "pack", "pack_lists", "pack_rows", "rows_from_lists"]


@dataclass
class PackedBatch:
    """A micro-batch packed into the shared-prompt layout, with the maps back to its rows.

    Shapes: ``T`` packed tokens, ``B`` rows (one per response), ``R_max`` the rows' response
    width, ``M`` real response tokens that have a predicting position (all of them unless a
    prompt is empty: the first token of a response to an empty prompt has no prediction).

    Attributes:
        input_ids: ``[1, T]`` int64 packed token ids.
        position_ids: ``[1, T]`` int64 positions for the model's RoPE (prompt ``0..P-1``, each
            response ``P..P+R-1``; taken from the rows' own position ids when given).
        layout: the :class:`dualkv.Layout` (on the batch's device).
        response_index: ``[B, R_max]`` int64 packed index of response token ``j`` of row ``b``
            (0 on padding).
        response_mask: ``[B, R_max]`` bool, True on the response tokens that are scored: every
            real response token that has a predicting position (the loss mask). The first token
            of a response to an empty prompt (P = 0) has none, so it is False there.
        real_mask: ``[B, R_max]`` bool, True on every real response token (padding False).
        response_ids: ``[B, R_max]`` int64 response token ids (0 on padding).
        row_group: ``[B]`` int64 index of each row's group in the layout.
        token_rows: ``[M]`` int64 flat index ``b * R_max + j`` of each predicted response token.
        token_sources: ``[M]`` int64 packed index of the hidden state that predicts the token
            (the prompt's last position for ``j = 0``: one row of N labels per group).
        token_labels: ``[M]`` int64 the token ids to score.
        group_rows: for each group in layout order, the indices of its rows (host tuple).
        num_rows: ``B``.
        max_response_len: ``R_max``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    layout: Layout
    response_index: torch.Tensor
    response_mask: torch.Tensor
    real_mask: torch.Tensor
    response_ids: torch.Tensor
    row_group: torch.Tensor
    token_rows: torch.Tensor
    token_sources: torch.Tensor
    token_labels: torch.Tensor
    group_rows: tuple[tuple[int, ...], ...]
    num_rows: int
    max_response_len: int

    def __post_init__(self) -> None:
        # Every size here changes from batch to batch (see dualkv.layout.mark_per_batch).
        for t in (self.input_ids, self.position_ids):
            mark_per_batch(t, 1)
        for t in (self.response_index, self.response_mask, self.real_mask, self.response_ids):
            mark_per_batch(t, 0, 1)
        for t in (self.row_group, self.token_rows, self.token_sources, self.token_labels):
            mark_per_batch(t, 0)

    @property
    def total_tokens(self) -> int:
        """Packed token count ``T``."""
        return self.layout.total_tokens

    @property
    def num_response_tokens(self) -> int:
        """Number of response tokens with a prediction (``M``)."""
        return int(self.token_rows.numel())

    @property
    def device(self) -> torch.device:
        """Device of the packed tensors."""
        return self.input_ids.device

    @property
    def token_reduction(self) -> float:
        """rho = tokens of the standard rows (P + R_i each) / packed tokens."""
        return self.layout.token_reduction

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for a HF model forward with ``attn_implementation="dualkv"``."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "dualkv_layout": self.layout,
            "use_cache": False,
        }

    def gather_responses(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token packed values ``[T, ...]`` (or ``[1, T, ...]``) to rows ``[B, R_max, ...]``.

        Padding positions are zero (every real response token is gathered, see ``real_mask``).
        Differentiable (a gather and a mask).
        """
        if x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == self.total_tokens:
            x = x[0]
        if x.shape[0] != self.total_tokens:
            raise ValueError(
                f"x must have {self.total_tokens} packed tokens in dim 0, "
                f"got shape {tuple(x.shape)}"
            )
        out = x.index_select(0, self.response_index.reshape(-1))
        out = out.view(self.num_rows, self.max_response_len, *x.shape[1:])
        mask = self.real_mask.view(self.num_rows, self.max_response_len, *([1] * (x.dim() - 1)))
        return torch.where(mask, out, 0)  # (a non-finite value at the gathered pad stays out)

    def scatter_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """Per-scored-token values ``[M]`` (in ``token_rows`` order) to rows ``[B, R_max]``.

        Zeros where no token is scored (padding). Differentiable (an index copy).
        """
        shape = self.response_mask.shape  # [B, R_max] (symbolic under torch.compile)
        flat = values.new_zeros(shape[0] * shape[1]).index_copy(0, self.token_rows, values)
        return flat.view(shape)

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch with every tensor (and the layout) on ``device``."""
        device = torch.device(device)
        fields = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                value = value.to(device)
            elif isinstance(value, Layout):
                value = value.to(device)
            fields[name] = value
        return PackedBatch(**fields)


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


def _group_name(group_ids: Any, row: int, code: int) -> Any:
    """The group id of ``row`` as the caller gave it (its code when grouped by content)."""
    if group_ids is None:
        return code
    return group_ids[row] if not isinstance(group_ids, torch.Tensor) else int(group_ids[row])


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


def pack_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    group_ids: Any = None,
    position_ids: torch.Tensor | None = None,
) -> PackedBatch:
    """Pack trainer rows (veRL layout) into the shared-prompt layout.

    Args:
        input_ids: ``[B, L]`` token ids; columns ``[0, prompt_width)`` hold the left-padded prompt,
            columns ``[prompt_width, L)`` the right-padded response.
        attention_mask: ``[B, L]`` 1 on real tokens, 0 on padding. Real prompt and response tokens
            are read from it (never from pad ids); each row's prompt must be contiguous and
            right-aligned, its response contiguous and left-aligned.
        prompt_width: the prompt columns' width.
        group_ids: ``[B]`` id of each row's prompt group (an int tensor, or a sequence/array of
            hashables such as veRL's ``uid`` strings). Rows of a group must have identical prompts
            token for token; rows of a group need not be adjacent; singleton groups are fine.
            ``None``: rows whose real prompt tokens are identical form a group (for micro-batches
            that have lost their group ids; the result is the same function either way).
        position_ids: optional ``[B, L]`` positions of the rows; when given, the packed positions
            are taken from them (rows sharing a prompt must have identical positions on its
            tokens; without group ids, rows are grouped by prompt tokens and positions), else
            they are the logical positions of the layout.

    Returns:
        A :class:`PackedBatch` on ``input_ids.device``; groups appear in first-seen row order, a
        group's responses in row order.

    Raises:
        ValueError: shapes that do not match, a mask that is not left/right padded as described,
            or rows of one group whose prompts (or prompt position ids) differ (naming the group
            and rows).
    """
    pw, pmask, plen, rlen = checked_row_lengths(
        input_ids, attention_mask, prompt_width, position_ids
    )
    num_rows, width = input_ids.shape
    rw = width - pw
    device = input_ids.device
    cols_r = torch.arange(rw)

    # --- groups ----------------------------------------------------------------------------------
    if group_ids is None:
        row_group = prompt_group_codes(input_ids, pmask, position_ids)
    else:
        row_group = group_codes(group_ids, num_rows)
    num_groups = int(row_group.max()) + 1 if num_rows else 0
    ref_row = torch.full((num_groups,), num_rows, dtype=torch.int64)
    ref_row.scatter_reduce_(0, row_group, torch.arange(num_rows), reduce="amin")
    ref_of_row = ref_row[row_group]
    prefix = plen[ref_row]  # [G]

    bad_len = plen != plen[ref_of_row]
    ids_p = input_ids[:, :pw]
    ref_dev = ref_of_row.to(device)
    same = (ids_p == ids_p.index_select(0, ref_dev)) | ~pmask.to(device)
    bad_tok = ~same.all(1)
    bad = bad_len | bad_tok.to("cpu")
    if bool(bad.any()):
        b = int(bad.nonzero()[0])
        g = int(row_group[b])
        gid = _group_name(group_ids, b, g)
        raise ValueError(
            f"rows of group {gid!r} have different prompts: row {b} (prompt length {int(plen[b])}) "
            f"differs from row {int(ref_row[g])} (prompt length {int(plen[ref_row[g]])}); rows "
            "sharing a group id must have identical prompts token for token"
        )
    if position_ids is not None:
        # The packed prompt carries its first row's positions: another row of the group whose
        # prompt positions differ would silently be computed at positions it does not have.
        ref_pos = position_ids[:, :pw].index_select(0, ref_dev.to(position_ids.device))
        same_pos = (position_ids[:, :pw] == ref_pos) | ~pmask.to(position_ids.device)
        bad_pos = ~same_pos.all(1).to("cpu")
        if bool(bad_pos.any()):
            b = int(bad_pos.nonzero()[0])
            g = int(row_group[b])
            raise ValueError(
                f"position_ids: rows {b} and {int(ref_row[g])} share a prompt (group "
                f"{_group_name(group_ids, b, g)!r}) but their prompt position ids differ; the "
                "packed prompt has one set of positions, so rows sharing a prompt must have "
                "identical position ids on their prompt tokens"
            )

    # --- segments: G prompts then B responses, sorted into packed order -----------------------
    seg_len = torch.cat([prefix, rlen])
    seg_row = torch.cat([ref_row, torch.arange(num_rows)])
    seg_col = torch.cat([pw - prefix, torch.full((num_rows,), pw, dtype=torch.int64)])
    key = torch.cat(
        [
            torch.arange(num_groups) * (num_rows + 1),
            row_group * (num_rows + 1) + 1 + torch.arange(num_rows),
        ]
    )
    order = torch.argsort(key)
    sorted_len = seg_len[order]
    sorted_start = torch.cumsum(sorted_len, 0) - sorted_len
    seg_start = torch.empty_like(sorted_start)
    seg_start[order] = sorted_start
    total = int(seg_len.sum())

    tok_seg = torch.repeat_interleave(order, sorted_len)  # segment of each packed token
    offset = torch.arange(total) - seg_start[tok_seg]
    src = seg_row[tok_seg] * width + seg_col[tok_seg] + offset
    src_dev = src.to(device)
    packed_ids = input_ids.reshape(-1).index_select(0, src_dev).to(torch.int64).view(1, total)

    # --- layout ----------------------------------------------------------------------------------
    rows_of_group: list[list[int]] = [[] for _ in range(num_groups)]
    for b, g in enumerate(row_group.tolist()):
        rows_of_group[g].append(b)
    rlen_list = rlen.tolist()
    response_lens = [[rlen_list[b] for b in rows] for rows in rows_of_group]
    layout = Layout(prefix.tolist(), response_lens, device=device)
    if position_ids is not None:
        packed_pos = (
            position_ids.reshape(-1).index_select(0, src_dev).to(torch.int64).view(1, total)
        )
    else:
        packed_pos = layout.position_ids.view(1, total)

    # --- maps back to rows ------------------------------------------------------------------------
    resp_start = seg_start[num_groups:]  # [B]
    prompt_end = seg_start[:num_groups] + prefix - 1  # [G], -1 + start when P = 0
    valid = cols_r[None, :] < rlen[:, None]  # == rmask
    response_index = torch.where(valid, resp_start[:, None] + cols_r[None, :], 0)
    sources = torch.where(cols_r[None, :] == 0, prompt_end[row_group][:, None], response_index - 1)
    has_source = valid & ((cols_r[None, :] > 0) | (prefix[row_group] > 0)[:, None])
    flat = has_source.reshape(-1).nonzero().flatten()
    response_ids = torch.where(valid.to(device), input_ids[:, pw:].to(torch.int64), 0)
    token_labels = response_ids.reshape(-1).index_select(0, flat.to(device))

    return PackedBatch(
        input_ids=packed_ids,
        position_ids=packed_pos,
        layout=layout,
        response_index=response_index.to(device),
        response_mask=has_source.to(device),
        real_mask=valid.to(device),
        response_ids=response_ids,
        row_group=row_group.to(device),
        token_rows=flat.to(device),
        token_sources=sources.reshape(-1)[flat].to(device),
        token_labels=token_labels,
        group_rows=tuple(tuple(r) for r in rows_of_group),
        num_rows=num_rows,
        max_response_len=rw,
    )


def _check_tokens(tokens: Any, name: str) -> None:
    """A token list must be a sequence of ints (numpy/torch integer scalars included)."""
    if isinstance(tokens, torch.Tensor) or type(tokens).__module__ == "numpy":
        tokens = tokens.tolist()
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise TypeError(f"{name} must be a list of token ids, got {type(tokens).__name__}")
    for j, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(
                f"{name}[{j}] must be an int token id, got {type(t).__name__} ({t!r}); "
                "tokenize the text first"
            )


def _check_nesting(items: Sequence[Any], name: str, what: str) -> None:
    """A token id where a list is expected: responses not nested per prompt (a common slip)."""
    for i, x in enumerate(items):
        if isinstance(x, numbers.Integral) or (isinstance(x, torch.Tensor) and x.dim() == 0):
            raise TypeError(
                f"{name}[{i}] is a token id ({x!r}), not {what}: prompts holds one list of token "
                "ids per prompt and responses, per prompt, the list of its responses (each a "
                "list of token ids), e.g. prompts=[[1, 2, 3]], responses=[[[4, 5], [6]]] (one "
                "response: responses=[[[4, 5]]])"
            )


def rows_from_lists(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[Sequence[int]]],
    pad_id: int = 0,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Build veRL-style trainer rows from token lists: one row per response.

    Args:
        prompts: G prompts, each a list of token ids.
        responses: for each prompt, its list of responses (lists of token ids).
        pad_id: id written on padding (never read back: the mask says what is real).
        device: where the returned tensors live.

    Returns:
        ``(input_ids [B, L], attention_mask [B, L], prompt_width, group_ids [B])`` with the prompt
        left-padded to ``prompt_width = max P`` and the response right-padded to ``max R``.
    """
    for name, value in (("prompts", prompts), ("responses", responses)):
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
            raise TypeError(
                f"{name} must be a list (one entry per prompt), got {type(value).__name__}"
            )
        _check_nesting(value, name, "a prompt" if name == "prompts" else "a list of responses")
    if len(prompts) != len(responses):
        raise ValueError(
            f"prompts has {len(prompts)} groups but responses has {len(responses)}; give one list "
            "of responses per prompt"
        )
    for g, (p, rs) in enumerate(zip(prompts, responses, strict=True)):
        _check_tokens(p, f"prompts[{g}]")
        if isinstance(rs, (str, bytes)) or not isinstance(rs, Sequence):
            raise TypeError(f"responses[{g}] must be a list of responses, got {type(rs).__name__}")
        _check_nesting(rs, f"responses[{g}]", "a response")
        for i, r in enumerate(rs):
            _check_tokens(r, f"responses[{g}][{i}]")
    pw = max((len(p) for p in prompts), default=0)
    rw = max((len(r) for rs in responses for r in rs), default=0)
    rows, masks, groups = [], [], []
    for g, (p, rs) in enumerate(zip(prompts, responses, strict=True)):
        for r in rs:
            pad_p, pad_r = pw - len(p), rw - len(r)
            rows.append(
                [pad_id] * pad_p + [int(t) for t in p] + [int(t) for t in r] + [pad_id] * pad_r
            )
            masks.append([0] * pad_p + [1] * (len(p) + len(r)) + [0] * pad_r)
            groups.append(g)
    width = pw + rw
    ids = torch.tensor(rows, dtype=torch.int64).view(len(rows), width)
    mask = torch.tensor(masks, dtype=torch.int64).view(len(rows), width)
    gid = torch.tensor(groups, dtype=torch.int64)
    return ids.to(device), mask.to(device), pw, gid.to(device)


def pack_lists(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[Sequence[int]]],
    device: torch.device | str | None = None,
) -> PackedBatch:
    """Pack plain token lists: ``prompts[g]`` and its responses ``responses[g][i]``.

    Rows (for the ``[B, R_max]`` outputs) are the responses in order, group after group.
    """
    ids, mask, pw, gid = rows_from_lists(prompts, responses, device=device)
    return pack_rows(ids, mask, pw, gid)


def pack(
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    prompt_width: int | None = None,
    group_ids: Any = None,
    *,
    position_ids: torch.Tensor | None = None,
    tree: bool = False,
    min_shared: int | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
    responses: Sequence[Sequence[Sequence[int]]] | None = None,
    device: torch.device | str | None = None,
) -> PackedBatch:
    """Pack a batch into the shared-prompt layout, from trainer rows or from token lists.

    Either trainer rows: ``pack(input_ids, attention_mask, prompt_width, group_ids=None,
    position_ids=None)`` (see :func:`pack_rows`; without group ids, rows with identical prompts
    are grouped), or token lists:
    ``pack(prompts=[[...], ...], responses=[[[...], ...], ...], device=None)`` (see
    :func:`pack_lists`). With rows, a ``device`` other than ``input_ids``' moves the rows there
    first.

    ``tree=True`` packs the rows as a prefix tree of everything they share, across groups and
    beyond the prompt (multi-turn and branching rollouts; group ids are then not needed): see
    :func:`dualkv.tree_packing.pack_rows_tree`, whose ``min_shared`` it passes on.

    Returns:
        A :class:`PackedBatch`: packed ``input_ids``/``position_ids`` ``[1, T]``, the ``layout``
        and the index maps back to the rows.
    """
    if prompts is not None or responses is not None:
        if input_ids is not None or attention_mask is not None:
            raise ValueError(
                "give either trainer rows (input_ids, ...) or prompts/responses, not both"
            )
        if prompts is None or responses is None:
            raise ValueError("token-list packing needs both prompts= and responses=")
        if not tree:
            if min_shared is not None:
                raise ValueError("min_shared applies to tree packing only: pass tree=True with it")
            return pack_lists(prompts, responses, device=device)
        input_ids, attention_mask, prompt_width, _ = rows_from_lists(
            prompts, responses, device=device
        )
    elif input_ids is None or attention_mask is None or prompt_width is None:
        raise ValueError(
            "row packing needs input_ids, attention_mask and prompt_width "
            "(or pass prompts= and responses=)"
        )
    if device is not None and torch.device(device) != input_ids.device:
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        if position_ids is not None:
            position_ids = position_ids.to(device)
    if tree:
        from .tree_packing import DEFAULT_MIN_SHARED, pack_rows_tree

        shared = DEFAULT_MIN_SHARED if min_shared is None else min_shared
        return pack_rows_tree(input_ids, attention_mask, prompt_width, position_ids, shared)
    if min_shared is not None:
        raise ValueError("min_shared applies to tree packing only: pass tree=True with it")
    return pack_rows(input_ids, attention_mask, prompt_width, group_ids, position_ids)
