"""Packing trainer rows as a prefix tree: :func:`pack_rows_tree` (``dualkv.pack(..., tree=True)``).

Every row (prompt and response together) is a root-to-leaf path of a forest of shared segments
found by :func:`dualkv.prefix_forest.prefix_forest`: rows share whatever they begin with, across
groups too (a system prompt, earlier turns of a trajectory, the start of branching rollouts).
The result is a :class:`dualkv.PackedBatch` on a tree :class:`dualkv.Layout` with the same maps
back to the rows as the prompt/response packing, so log-probs, losses and the integrations use it
unchanged: a response token's log-prob is read from the packed hidden state of the token before it
on its own row's path (at a branch point, the parent's last token predicts each child's first).
"""

from __future__ import annotations

import torch

from .layout import Layout
from .packed_batch import PackedBatch, batch_from_row_maps
from .prefix_forest import PrefixForest, SortedRows, prefix_forest, sorted_rows
from .trainer_rows import checked_row_lengths

__all__ = [
    "DEFAULT_MIN_SHARED",
    "TREE_MIN_SAVING",
    "pack_rows_tree",
    "row_forest",
    "sorted_trainer_rows",
    "tree_saves",
]

# Shared segments shorter than this are repeated in each branch instead of split off (a branch
# point ends a 128-token tile early in every layer's attention; a few shared tokens do not pay
# for it).
DEFAULT_MIN_SHARED = 64

# A trainer that picks the packing itself (the veRL engine, DualKVGRPOTrainer) runs the tree when
# it packs at least this fraction fewer tokens than the prompt-group packing: the tree kernel's
# target is 90% of the depth-two kernel's throughput (issue 33) and a branch point ends a tile
# early in every layer, so a smaller saving may not pay; the depth-two packing stays the measured
# fast path.
TREE_MIN_SAVING = 0.1


def tree_saves(flat_tokens: int, tree_tokens: int) -> bool:
    """Whether rows packing to ``flat_tokens`` as prompt groups and ``tree_tokens`` as a prefix
    tree save at least :data:`TREE_MIN_SAVING` of the tokens as the tree."""
    return tree_tokens < flat_tokens and tree_tokens <= (1.0 - TREE_MIN_SAVING) * flat_tokens


def _row_keys(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    first_col: torch.Tensor,
    seq_len: torch.Tensor,
) -> torch.Tensor:
    """Left-aligned keys of the rows' tokens (host): the token ids, and the position ids when
    given (tokens are shared only where both agree). Row ``b``'s ``seq_len[b]`` real tokens are
    contiguous from column ``first_col[b]`` (``prompt_width - P_b``)."""
    width = input_ids.shape[1]
    cols = torch.arange(width)
    gather = (first_col[:, None] + cols[None, :]).clamp(max=max(width - 1, 0))
    ids = input_ids.detach().to("cpu", torch.int64).gather(1, gather)
    if position_ids is None:
        return ids
    pos = position_ids.detach().to("cpu", torch.int64).gather(1, gather)
    # Positions 0, 1, ... on every row's tokens (veRL's, TRL's) share exactly where the ids do:
    # then the ids alone are the keys (half the host work). (Past a row's end nothing is read.)
    real = cols[None, :] < seq_len[:, None]
    if bool(((pos == cols[None, :]) | ~real).all()):
        return ids
    return torch.stack([ids, pos], -1)


def sorted_trainer_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    position_ids: torch.Tensor | None = None,
) -> SortedRows:
    """The :class:`dualkv.prefix_forest.SortedRows` of trainer rows (arguments as
    :func:`pack_rows_tree`): :func:`dualkv.prefix_forest.forest_tokens` on it and a subset of
    the rows gives the packed tokens of :func:`pack_rows_tree` on that subset."""
    pw, _pmask, plen, rlen = checked_row_lengths(
        input_ids, attention_mask, prompt_width, position_ids
    )
    return sorted_rows(_row_keys(input_ids, position_ids, pw - plen, plen + rlen), plen + rlen)


def row_forest(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    position_ids: torch.Tensor | None = None,
    min_shared: int = DEFAULT_MIN_SHARED,
) -> PrefixForest:
    """The prefix forest :func:`pack_rows_tree` packs these rows with (arguments as there), so a
    caller can weigh the tree (``total_tokens``) before packing it (pass it as ``forest``)."""
    pw, _pmask, plen, rlen = checked_row_lengths(
        input_ids, attention_mask, prompt_width, position_ids
    )
    keys = _row_keys(input_ids, position_ids, pw - plen, plen + rlen)
    return prefix_forest(keys, plen + rlen, min_shared)


def pack_rows_tree(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    position_ids: torch.Tensor | None = None,
    min_shared: int = DEFAULT_MIN_SHARED,
    forest: PrefixForest | None = None,
) -> PackedBatch:
    """Pack trainer rows (veRL layout) as a prefix tree of everything they share.

    Args:
        input_ids, attention_mask, prompt_width, position_ids: trainer rows as
            :func:`dualkv.pack_rows` takes them (left-padded prompt, right-padded response).
            Tokens are shared where rows agree on token ids and, when given, on position ids.
        min_shared: shared segments shorter than this many tokens are not split off (see
            :func:`dualkv.prefix_forest.prefix_forest`); 1 shares every common prefix.
        forest: :func:`row_forest` of these same arguments, when the caller has it already.

    Returns:
        A :class:`PackedBatch` whose ``layout`` is ``Layout.tree(...)``; ``row_group`` and
        ``group_rows`` name each row's tree (rows whose paths share a root segment; -1 for a row
        without tokens). The response maps (``response_index``, ``token_sources``, ...) are those
        of :func:`dualkv.pack_rows`.
    """
    pw, _pmask, plen, rlen = checked_row_lengths(
        input_ids, attention_mask, prompt_width, position_ids
    )
    num_rows, width = input_ids.shape
    rw = width - pw
    device = input_ids.device
    first_col = pw - plen
    seq_len = plen + rlen
    if forest is None:
        forest = prefix_forest(
            _row_keys(input_ids, position_ids, first_col, seq_len), seq_len, min_shared
        )
    elif tuple(forest.token_index.shape) != (num_rows, width):
        raise ValueError(
            f"forest is of {tuple(forest.token_index.shape)} rows x columns, the rows are "
            f"{(num_rows, width)}: pass row_forest(...) of these rows"
        )
    layout = Layout.tree(forest.parents, forest.lengths, device=device)
    total = forest.total_tokens

    # --- packed tokens from their source rows ----------------------------------------------------
    seg_len = torch.tensor(forest.lengths, dtype=torch.int64)
    seg_first = (
        (
            torch.tensor(forest.source_row, dtype=torch.int64) * width
            + first_col[torch.tensor(forest.source_row, dtype=torch.int64)]
            + torch.tensor(forest.source_col, dtype=torch.int64)
        )
        if forest.lengths
        else torch.zeros(0, dtype=torch.int64)
    )
    seg_start = torch.cumsum(seg_len, 0) - seg_len
    tok_seg = torch.repeat_interleave(torch.arange(seg_len.numel()), seg_len)
    src = (seg_first[tok_seg] + torch.arange(total) - seg_start[tok_seg]).to(device)
    packed_ids = input_ids.reshape(-1).index_select(0, src).to(torch.int64).view(1, total)
    if position_ids is not None:
        packed_pos = position_ids.reshape(-1).index_select(0, src).to(torch.int64).view(1, total)
    else:
        packed_pos = layout.position_ids.view(1, total)

    # --- maps back to rows ------------------------------------------------------------------------
    cols_r = torch.arange(rw)
    valid = cols_r[None, :] < rlen[:, None]
    at = (plen[:, None] + cols_r[None, :]).clamp(max=max(width - 1, 0))
    response_index = torch.where(valid, forest.token_index.gather(1, at), 0)
    before = (at - 1).clamp(min=0)
    sources = forest.token_index.gather(1, before)
    has_source = valid & (plen[:, None] + cols_r[None, :] > 0)

    # Trees: the root segment of each row's path, numbered in packed order.
    root = list(range(len(forest.parents)))
    for i, p in enumerate(forest.parents):
        if p >= 0:
            root[i] = root[p]
    tree_of_root = {r: t for t, r in enumerate(sorted(set(root)))}
    seg_of_token = tok_seg.tolist()
    row_tree = [
        tree_of_root[root[seg_of_token[int(forest.token_index[b, 0])]]] if int(seq_len[b]) else -1
        for b in range(num_rows)
    ]
    rows_of_tree: list[list[int]] = [[] for _ in range(len(tree_of_root))]
    for b, t in enumerate(row_tree):
        if t >= 0:
            rows_of_tree[t].append(b)
    return batch_from_row_maps(
        input_ids, pw, packed_ids, packed_pos, layout, response_index, sources, has_source,
        valid, torch.tensor(row_tree, dtype=torch.int64), rows_of_tree,
    )  # fmt: skip
