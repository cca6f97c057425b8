"""Shared prefixes of token rows as a forest of segments: a compressed token trie.

Rows that begin with the same tokens (at the same positions) share those tokens' hidden states
under causal attention, wherever the rows come from: the responses of one prompt, the prompts of
several groups behind one system prompt, the turns of one agent trajectory, branching rollouts.
:func:`prefix_forest` finds the largest such sharing for a micro-batch and lists it as segments in
depth-first packed order, the input of :meth:`dualkv.Layout.tree`.

The trie is built from the rows sorted lexicographically and the longest common prefix of each
adjacent pair (one vectorised comparison), then one pass over the rows with a stack: host work
linear in the number of rows (plus the tensor ops), done once per batch. :func:`forest_tokens`
prices the forest of any subset of a batch's rows from the batch's :func:`sorted_rows` alone (no
tensor work), for micro-batch partitions that keep rows sharing prefixes together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["PrefixForest", "SortedRows", "forest_tokens", "prefix_forest", "sorted_rows"]


@dataclass(frozen=True)
class PrefixForest:
    """Segments of a micro-batch's rows in packed (depth-first) order.

    Attributes:
        parents: parent segment of each segment (-1 for a root); ``parents[i] < i``.
        lengths: tokens of each segment (> 0).
        source_row: a row whose sequence holds the segment's tokens.
        source_col: index in that row's sequence of the segment's first token.
        token_index: ``[B, L]`` int64 packed index of token ``j`` of row ``b``'s sequence (0 past
            the row's length).
    """

    parents: list[int]
    lengths: list[int]
    source_row: list[int]
    source_col: list[int]
    token_index: torch.Tensor

    @property
    def total_tokens(self) -> int:
        """Packed tokens (sum of the segment lengths)."""
        return sum(self.lengths)


@dataclass(frozen=True)
class SortedRows:
    """A batch's distinct rows in lexicographic order with the common prefix of each adjacent
    pair: what the trie of the rows, or of any subset of them, is built from.

    Attributes:
        row_of: the distinct row (its sorted index) of each row.
        lengths: tokens of each distinct row.
        lcp: common prefix of distinct rows ``u`` and ``u + 1`` (one fewer than ``lengths``).
        first_row: the first row (in batch order) of each distinct row.
    """

    row_of: list[int]
    lengths: list[int]
    lcp: list[int]
    first_row: list[int]


def sorted_rows(keys: torch.Tensor, lengths: torch.Tensor) -> SortedRows:
    """The :class:`SortedRows` of ``B`` rows (``keys`` and ``lengths`` as :func:`prefix_forest`
    takes them)."""
    if keys.dim() == 2:
        keys = keys.unsqueeze(-1)
    if keys.dim() != 3:
        raise ValueError(f"keys must be [B, L] or [B, L, K], got shape {tuple(keys.shape)}")
    if keys.is_floating_point() or keys.is_complex():
        raise TypeError(f"keys must be an integer tensor, got {keys.dtype}")
    num_rows, width = keys.shape[0], keys.shape[1]
    lengths = lengths.detach().to("cpu", torch.int64).reshape(-1)
    if lengths.numel() != num_rows:
        raise ValueError(f"lengths must have one entry per row ({num_rows}), got {lengths.numel()}")
    if bool((lengths < 0).any()) or bool((lengths > width).any()):
        raise ValueError(f"lengths must lie in [0, {width}], got {lengths.tolist()}")

    # --- distinct rows, sorted: a row that is a prefix of another sorts first ---------------
    k = keys.detach().to("cpu", torch.int64)
    cols = torch.arange(width)
    real = cols[None, :] < lengths[:, None]
    # Past its length a row reads a value below every key, so a prefix sorts before its extensions.
    low = int(k.min()) - 1 if k.numel() else -1
    k = torch.where(real[:, :, None], k, low)
    uniq, row_of = torch.unique(k.reshape(num_rows, -1), dim=0, return_inverse=True)
    uniq = uniq.view(-1, width, k.shape[2])
    num_uniq = uniq.shape[0]
    ulen = torch.zeros(num_uniq, dtype=torch.int64).scatter_reduce(
        0, row_of, lengths, reduce="amax", include_self=False
    )
    first_row = torch.full((num_uniq,), num_rows, dtype=torch.int64).scatter_reduce(
        0, row_of, torch.arange(num_rows), reduce="amin", include_self=True
    )
    # Longest common prefix of each adjacent pair of distinct rows.
    if num_uniq > 1:
        same = (uniq[1:] == uniq[:-1]).all(-1)
        same &= cols[None, :] < torch.minimum(ulen[1:], ulen[:-1])[:, None]
        lcp = same.to(torch.int64).cumprod(1).sum(1).tolist()
    else:
        lcp = []
    return SortedRows(row_of.reshape(-1).tolist(), ulen.tolist(), lcp, first_row.tolist())


def forest_tokens(rows: SortedRows, subset: Sequence[int], min_shared: int = 1) -> int:
    """Packed tokens of :func:`prefix_forest` on the rows ``subset`` of a batch (row indices),
    from the batch's :class:`SortedRows`: no tensor work, linear in the rows' span of the sorted
    order, so a micro-batch partition can price many candidate subsets."""
    if min_shared < 1:
        raise ValueError(f"min_shared must be >= 1, got {min_shared}")
    us = sorted({rows.row_of[b] for b in subset})
    # Sorted rows a < b share min(lcp[a:b]): the common prefix of their restriction's neighbours.
    lcp = [min(rows.lcp[a:b]) for a, b in zip(us[:-1], us[1:], strict=True)]
    trie = _Trie([rows.lengths[u] for u in us], lcp)
    return sum(trie.segments(list(range(len(trie.depth))), min_shared)[1])


class _Trie:
    """The compressed trie of sorted distinct rows (node 0: a virtual root at depth 0)."""

    def __init__(self, ulen: list[int], lcp: list[int]) -> None:
        depth, parent, terminal = [0], [-1], [0] * len(ulen)
        stack = [0]
        for u in range(len(ulen)):
            common = lcp[u - 1] if u else 0
            last = -1
            while depth[stack[-1]] > common:
                last = stack.pop()
            if depth[stack[-1]] < common:  # split the edge into `last` at the common depth
                depth.append(common)
                parent.append(stack[-1])
                parent[last] = len(depth) - 1
                stack.append(len(depth) - 1)
            if ulen[u] > common:
                depth.append(ulen[u])
                parent.append(stack[-1])
                stack.append(len(depth) - 1)
            terminal[u] = stack[-1]
        self.depth, self.parent, self.terminal = depth, parent, terminal

    def segments(
        self, first: list[int], min_shared: int
    ) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
        """Pre-order walk (children in increasing ``first``); a segment ends at a branch point
        (two or more children) or a leaf, not where a row ends inside a path (a node with one
        child: per-turn rows, each a prefix of the next, share one segment; its attention is the
        same and it has fewer partial tiles and a shorter ancestor walk); a short inner segment is
        folded into its branches. Returns ``(parents, lengths, node, start, node_seg)``: each
        segment's parent segment, length, trie node whose tokens it holds (its last) and depth of
        its first token, and the segment holding each row-ending node's last token on its rows'
        paths."""
        depth, num_nodes = self.depth, len(self.depth)
        ends_here = [False] * num_nodes
        for n in self.terminal:
            ends_here[n] = True
        children: list[list[int]] = [[] for _ in range(num_nodes)]
        for n in range(1, num_nodes):
            children[self.parent[n]].append(n)
        parents: list[int] = []
        seg_len: list[int] = []
        seg_node: list[int] = []
        seg_start: list[int] = []
        node_seg = [-1] * num_nodes

        def new_segment(n: int, pseg: int, s0: int, inside: list[int]) -> int:
            """A segment of the tokens [s0, depth[n]) ending at node n, holding the rows that
            end at n and at the nodes ``inside`` it."""
            for m in (*inside, n):
                node_seg[m] = len(parents)
            parents.append(pseg)
            seg_len.append(depth[n] - s0)
            seg_node.append(n)
            seg_start.append(s0)
            return len(parents) - 1

        # (node, segment index of its parent, depth its tokens start at, row-ending nodes passed
        # on the way since that depth)
        todo: list[tuple[int, int, int, list[int]]] = [
            (c, -1, 0, []) for c in sorted(children[0], key=lambda c: first[c], reverse=True)
        ]
        while todo:
            n, pseg, s0, inside = todo.pop()
            kids = sorted(children[n], key=lambda c: first[c])
            if len(kids) == 1:  # a row ends here, inside a path: the segment goes on
                todo.append((kids[0], pseg, s0, [*inside, n]))
                continue
            if kids and depth[n] - s0 < min_shared:
                # Rows ending here or inside keep their tokens in a segment of their own.
                if ends_here[n] or inside:
                    new_segment(n, pseg, s0, inside)
                todo.extend((c, pseg, s0, []) for c in reversed(kids))
                continue
            seg = new_segment(n, pseg, s0, inside)
            todo.extend((c, seg, depth[n], []) for c in reversed(kids))
        return parents, seg_len, seg_node, seg_start, node_seg


def prefix_forest(keys: torch.Tensor, lengths: torch.Tensor, min_shared: int = 1) -> PrefixForest:
    """The shared-prefix forest of ``B`` rows.

    Args:
        keys: ``[B, L]`` or ``[B, L, K]`` integer keys of each row's tokens, left-aligned (token
            ``j`` of row ``b`` at ``keys[b, j]``); tokens are shared only where every key
            component agrees (e.g. token id and position id). Values past a row's length are
            never read.
        lengths: ``[B]`` tokens of each row.
        min_shared: a shared segment shorter than this is not split off: its tokens are repeated
            in each branch below it (a branch point costs a tile boundary; a few shared tokens do
            not pay for it). 1 shares every common prefix.

    Returns:
        A :class:`PrefixForest`. Children follow their parent in the order of the first row that
        reaches them, so rows that share only a prompt are packed as
        ``[prompt | r_1 | ... | r_N]`` in row order, groups in first-seen order. Identical rows
        share every token (their per-token results are the same function; their gradients sum).
    """
    if min_shared < 1:
        raise ValueError(f"min_shared must be >= 1, got {min_shared}")
    rows = sorted_rows(keys, lengths)
    num_rows, width = keys.shape[0], keys.shape[1]
    trie = _Trie(rows.lengths, rows.lcp)
    num_nodes = len(trie.depth)
    first = [num_rows] * num_nodes  # first row (in batch order) whose path reaches the node
    for u in sorted(range(len(rows.lengths)), key=lambda x: rows.first_row[x]):
        n = trie.terminal[u]
        while n >= 0 and first[n] > rows.first_row[u]:
            first[n] = rows.first_row[u]
            n = trie.parent[n]
    parents, seg_len, seg_node, seg_start, node_seg = trie.segments(first, min_shared)

    # --- packed order is the list order; token maps -----------------------------------------------
    packed_start = [0] * len(seg_len)
    total = 0
    for i, n in enumerate(seg_len):
        packed_start[i] = total
        total += n
    source_row = [first[seg_node[i]] for i in range(len(seg_len))]
    token_index = torch.zeros(num_rows, width, dtype=torch.int64)
    path_cache: dict[int, list[int]] = {}
    for b in range(num_rows):
        u = rows.row_of[b]
        if u not in path_cache:
            path_cache[u] = _path(trie.terminal[u], node_seg, parents)
        for s in path_cache[u]:  # (the last segment may go on past the row's end)
            lo = seg_start[s]
            n = min(seg_len[s], rows.lengths[u] - lo)
            token_index[b, lo : lo + n] = torch.arange(packed_start[s], packed_start[s] + n)
    return PrefixForest(parents, seg_len, source_row, seg_start, token_index)


def _path(node: int, node_seg: list[int], seg_parents: list[int]) -> list[int]:
    """Segments from the root to the segment that ends a row at trie node ``node``."""
    path = []
    s = node_seg[node] if node > 0 else -1
    while s >= 0:
        path.append(s)
        s = seg_parents[s]
    return path[::-1]
