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
import reprlib
from collections.abc import Sequence
from typing import Any

import torch

from .layout import Layout
from .packed_batch import PackedBatch, batch_from_row_maps
from .trainer_rows import checked_row_lengths, group_codes, prompt_group_codes
from .tree_packing import DEFAULT_MIN_SHARED, pack_rows_tree

__all__ = ["PackedBatch", "pack", "pack_lists", "pack_rows", "rows_from_lists", "rows_from_trees"]


def _group_name(group_ids: Any, row: int, code: int) -> Any:
    """The group id of ``row`` as the caller gave it (its code when grouped by content)."""
    if group_ids is None:
        return code
    return group_ids[row] if not isinstance(group_ids, torch.Tensor) else int(group_ids[row])


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
    return batch_from_row_maps(
        input_ids, pw, packed_ids, packed_pos, layout, response_index, sources, has_source,
        valid, row_group, rows_of_group,
    )  # fmt: skip


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


def _tree_node(node: Any, where: str) -> tuple[Sequence[int], Sequence[Any]]:
    """A node of an explicit tree: ``(tokens, children)``, checked, naming where it is."""
    if not isinstance(node, (tuple, list)) or len(node) != 2:
        raise TypeError(
            f"{where} must be a node (tokens, children): a list of token ids and a list of child "
            f"nodes, e.g. ([1, 2], [([3], []), ([4, 5], [])]); got {reprlib.repr(node)}"
        )
    tokens, children = node
    _check_tokens(tokens, f"{where}[0]")
    if isinstance(children, (str, bytes)) or not isinstance(children, Sequence):
        raise TypeError(f"{where}[1] must be a list of child nodes, got {type(children).__name__}")
    return tokens, children


def rows_from_trees(
    trees: Sequence[Any], pad_id: int = 0, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Build trainer rows from explicit trees of token lists: one row per leaf.

    Args:
        trees: each a node ``(tokens, children)``: a list of token ids and a list of child nodes
            (``[]`` for a leaf). A tree's root is its rows' prompt; each root-to-leaf path after
            the root is a row's response (a root without children: one row, empty response).
        pad_id, device: as :func:`rows_from_lists`.

    Returns:
        :func:`rows_from_lists`' ``(input_ids, attention_mask, prompt_width, group_ids)``: the
        rows tree by tree, the leaves of a tree in depth-first order (children in list order);
        ``group_ids`` is the tree's index.
    """
    if isinstance(trees, (str, bytes)) or not isinstance(trees, Sequence):
        raise TypeError(f"trees must be a list of (tokens, children) nodes, got {type(trees)}")
    prompts: list[Sequence[int]] = []
    responses: list[list[list[int]]] = []
    for t, tree in enumerate(trees):
        root, children = _tree_node(tree, f"trees[{t}]")
        paths: list[list[int]] = []
        # depth first, children in order: a stack of (node, where, the path's tokens above it)
        stack: list[tuple[Any, str, list[int]]] = [
            (c, f"trees[{t}][1][{i}]", []) for i, c in reversed(list(enumerate(children)))
        ]
        while stack:
            node, where, above = stack.pop()
            tokens, kids = _tree_node(node, where)
            path = above + [int(x) for x in tokens]
            if not kids:
                paths.append(path)
            stack.extend((c, f"{where}[1][{i}]", path) for i, c in reversed(list(enumerate(kids))))
        prompts.append(root)
        responses.append(paths if children else [[]])
    return rows_from_lists(prompts, responses, pad_id, device)


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
    trees: Sequence[Any] | None = None,
    device: torch.device | str | None = None,
) -> PackedBatch:
    """Pack a batch into the shared-prompt layout, from trainer rows, token lists or trees.

    Either trainer rows: ``pack(input_ids, attention_mask, prompt_width, group_ids=None,
    position_ids=None)`` (see :func:`pack_rows`; without group ids, rows with identical prompts
    are grouped), or token lists:
    ``pack(prompts=[[...], ...], responses=[[[...], ...], ...], device=None)`` (see
    :func:`pack_lists`). With rows, a ``device`` other than ``input_ids``' moves the rows there
    first.

    ``tree=True`` packs the rows as a prefix tree of everything they share, across groups and
    beyond the prompt (multi-turn and branching rollouts; group ids are then not needed): see
    :func:`dualkv.tree_packing.pack_rows_tree`, whose ``min_shared`` it passes on.

    Or explicit trees: ``pack(trees=[(root_tokens, [(tokens, [...]), ...]), ...])``, each node a
    list of token ids and its child nodes (see :func:`rows_from_trees`): one row per leaf (its
    prompt the root, its response the path below it), packed as a prefix tree (``tree`` is
    implied; ``min_shared`` as above, so branches shorter than it are repeated per path).

    Returns:
        A :class:`PackedBatch`: packed ``input_ids``/``position_ids`` ``[1, T]``, the ``layout``
        and the index maps back to the rows.
    """
    if trees is not None:
        given = {
            "input_ids": input_ids, "attention_mask": attention_mask, "prompt_width": prompt_width,
            "group_ids": group_ids, "position_ids": position_ids, "prompts": prompts,
            "responses": responses,
        }  # fmt: skip
        extra = [name for name, value in given.items() if value is not None]
        if extra:
            raise ValueError(
                f"give trees= alone (with min_shared / device), not with {', '.join(extra)}: the "
                "rows, their groups and positions come from the trees"
            )
        if not isinstance(trees, Sequence) or isinstance(trees, (str, bytes)) or not trees:
            raise ValueError("trees= needs at least one (tokens, children) tree")
        input_ids, attention_mask, prompt_width, _ = rows_from_trees(trees, device=device)
        tree = True
    elif prompts is not None or responses is not None:
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
        shared = DEFAULT_MIN_SHARED if min_shared is None else min_shared
        return pack_rows_tree(input_ids, attention_mask, prompt_width, position_ids, shared)
    if min_shared is not None:
        raise ValueError("min_shared applies to tree packing only: pass tree=True with it")
    return pack_rows(input_ids, attention_mask, prompt_width, group_ids, position_ids)
