"""Micro-batches of whole prompt groups for :class:`dualkv.integrations.trl.DualKVGRPOTrainer`.

TRL shuffles a generation batch's rows and cuts it into micro-batches, scattering a prompt's
completions; here whole groups (rows with identical prompts) are shuffled and placed, and groups
whose prompts share a prefix (:func:`prefix_families`: a system prompt, earlier turns) go to one
micro-batch where they fit, so that packing shares them.
"""

from __future__ import annotations

from typing import Any

import torch

from ..prefix_forest import prefix_forest
from ..trainer_rows import group_codes, prompt_group_codes
from ..tree_packing import DEFAULT_MIN_SHARED

__all__ = [
    "chunks_of_groups",
    "group_microbatches",
    "groups_cut",
    "prefix_families",
    "prompt_groups",
    "select_rows",
]


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64 group code of each row (first-seen order): rows with identical real prompt
    tokens (left-padded ``prompt_ids`` under ``prompt_mask``) share a code."""
    return prompt_group_codes(prompt_ids, prompt_mask != 0)


def prefix_families(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    groups: torch.Tensor,
    max_rows: int,
    min_shared: int = DEFAULT_MIN_SHARED,
) -> torch.Tensor:
    """``[B]`` int64 family code of each row: prompt groups whose prompts share a prefix of at
    least ``min_shared`` tokens, in families of at most ``max_rows`` rows where they can be.

    The prompts' prefix forest (:func:`dualkv.prefix_forest.prefix_forest`, on the real tokens
    from their first) is walked from its roots: a subtree whose groups hold at most ``max_rows``
    rows is one family; a larger one (a system prompt shared by the whole batch) is split into its
    children's subtrees, and the groups whose prompts end on its own segment are families of
    their own. Rows of a group share its family. (Rows that share more than a prompt share a
    group, or prompts of which one is a prefix of the other: a later turn's prompt holds the
    earlier turns.)

    Args:
        prompt_ids, prompt_mask: ``[B, P]`` TRL's left-padded prompts and their mask.
        groups: ``[B]`` group code of each row (:func:`prompt_groups`).
        max_rows: the largest family wanted (a micro-batch's rows).
        min_shared: shorter shared prefixes do not make a family (as the tree packing's).
    """
    codes = groups.detach().to("cpu", torch.int64).reshape(-1)
    num_rows = codes.numel()
    if num_rows == 0:
        return codes.clone()
    num_groups = int(codes.max()) + 1
    rep_row = torch.full((num_groups,), num_rows, dtype=torch.int64)
    rep_row.scatter_reduce_(0, codes, torch.arange(num_rows), reduce="amin")
    plen = (prompt_mask.detach().to("cpu") != 0).sum(1)[rep_row]
    width = prompt_ids.shape[1]
    at = ((width - plen)[:, None] + torch.arange(width)[None, :]).clamp(max=max(width - 1, 0))
    keys = prompt_ids.detach().to("cpu", torch.int64)[rep_row].gather(1, at)
    forest = prefix_forest(keys, plen, min_shared)
    parents = forest.parents
    ends = torch.cumsum(torch.tensor(forest.lengths, dtype=torch.int64), 0)
    last = forest.token_index.gather(1, (plen - 1).clamp(min=0)[:, None]).flatten()
    end_seg = torch.where(plen > 0, torch.searchsorted(ends, last, right=True), -1).tolist()
    sizes = torch.bincount(codes, minlength=num_groups).tolist()

    at_seg: list[list[int]] = [[] for _ in parents]  # groups whose prompt ends on the segment
    children: list[list[int]] = [[] for _ in parents]
    rows_below = [0] * len(parents)
    for g, s in enumerate(end_seg):
        if s >= 0:
            at_seg[s].append(g)
            rows_below[s] += sizes[g]
    for s in range(len(parents) - 1, -1, -1):  # parents[s] < s
        if parents[s] >= 0:
            rows_below[parents[s]] += rows_below[s]
            children[parents[s]].append(s)
    family = [-1] * num_groups
    count = 0
    todo = [s for s in range(len(parents)) if parents[s] < 0][::-1]
    while todo:
        s = todo.pop()
        if rows_below[s] <= max_rows:  # the whole subtree is one family
            below = [s]
            while below:
                t = below.pop()
                for g in at_seg[t]:
                    family[g] = count
                below.extend(children[t])
            count += 1
            continue
        for g in at_seg[s]:
            family[g] = count
            count += 1
        todo.extend(sorted(children[s], reverse=True))
    for g in range(num_groups):  # (an empty prompt)
        if family[g] < 0:
            family[g] = count
            count += 1
    return group_codes(torch.tensor(family, dtype=torch.int64)[codes], num_rows)


def group_microbatches(
    groups: torch.Tensor,
    num_chunks: int,
    generator: torch.Generator | None = None,
    families: torch.Tensor | None = None,
) -> tuple[list[torch.Tensor], int]:
    """Split rows into ``num_chunks`` micro-batches of equal size, keeping groups whole.

    Groups are taken in a random order; a group of at least a micro-batch's size fills whole
    micro-batches, and the remainders are placed largest first into the micro-batch with the
    least room that holds them whole. A remainder that fits nowhere is cut over the micro-batches
    with the most room (so the fewest groups are cut). The random order comes from one
    ``torch.randperm(B)`` (groups in the order their rows first appear in it), the same draw as
    TRL's row shuffle, so the random stream after it (the next generation) is TRL's.

    With ``families`` (groups whose rows share more than their own prompt, e.g.
    :func:`prefix_families`), the remainders of a family are placed together, largest family
    first, where one micro-batch holds them all (else group by group as above); this placement
    is kept only when it cuts no more groups (:func:`groups_cut`) than the one without families.

    Args:
        groups: ``[B]`` int64 group code of each row.
        num_chunks: micro-batch count; must divide ``B``.
        generator: the random source (torch's global one by default, as TRL's shuffle).
        families: optional ``[B]`` int64 family code of each row (the same on a group's rows).

    Returns:
        ``(row indices of each micro-batch, number of groups cut)``: :func:`groups_cut`, the
        groups whose rows are in more than one micro-batch, each counted once (a group larger
        than a micro-batch always is).
    """
    num_rows = groups.numel()
    if num_chunks < 1 or num_rows % num_chunks:
        raise ValueError(f"{num_rows} rows cannot be split into {num_chunks} equal micro-batches")
    size = num_rows // num_chunks
    codes = groups.detach().to("cpu", torch.int64)
    perm = torch.randperm(num_rows, generator=generator)
    members: dict[int, list[int]] = {}
    for r in perm.tolist():  # dict order: groups as their rows first appear in the permutation
        members.setdefault(int(codes[r]), [])
    for r in range(num_rows):  # a group's rows in row order
        members[int(codes[r])].append(r)
    bins: list[list[int]] = []
    rests: list[list[int]] = []
    for rows in members.values():
        while len(rows) >= size:  # larger than a micro-batch: micro-batch-sized pieces
            bins.append(rows[:size])
            rows = rows[size:]
        if rows:
            rests.append(rows)
    num_open = num_chunks - len(bins)
    open_bins = _place([[rows] for rows in rests], num_open, size)
    cut = groups_cut(bins + open_bins, codes)
    if families is not None:
        fam = families.detach().to("cpu", torch.int64).reshape(-1)
        if fam.numel() != num_rows:
            raise ValueError(f"families must have one code per row ({num_rows}), got {fam.numel()}")
        units: dict[int, list[list[int]]] = {}
        for rows in rests:  # (families in the random order of their first remainder)
            if bool((fam[rows] != fam[rows[0]]).any()):
                raise ValueError(f"rows {rows} of one group have different families")
            units.setdefault(int(fam[rows[0]]), []).append(rows)
        by_family = _place(list(units.values()), num_open, size)
        family_cut = groups_cut(bins + by_family, codes)
        if family_cut <= cut:
            open_bins, cut = by_family, family_cut
    return [torch.tensor(c, dtype=torch.int64) for c in bins + open_bins], cut


def groups_cut(chunks: list[list[int]], groups: torch.Tensor) -> int:
    """The number of groups whose rows are in more than one of ``chunks`` (row indices): each
    such group counts once, however many micro-batches it spans."""
    codes = groups.detach().to("cpu", torch.int64).reshape(-1).tolist()
    chunks_of: dict[int, set[int]] = {}
    for c, rows in enumerate(chunks):
        for r in rows:
            chunks_of.setdefault(codes[r], set()).add(c)
    return sum(len(where) > 1 for where in chunks_of.values())


def _place(units: list[list[list[int]]], num_bins: int, size: int) -> list[list[int]]:
    """Rows of ``units`` (each a list of groups' rows) into ``num_bins`` bins of ``size`` rows:
    a unit, largest first, goes whole into the bin with the least room that holds it; else its
    groups, largest first, each into such a bin, and a group that fits nowhere is cut over the
    bins with the most room."""
    bins: list[list[int]] = [[] for _ in range(num_bins)]

    def fullest_fitting(n: int) -> list[int] | None:
        fits = [b for b in bins if size - len(b) >= n]
        return max(fits, key=len) if fits else None  # least room left that still holds n rows

    # (sorts are stable: ties keep the given, random, order)
    for unit in sorted(units, key=lambda u: sum(len(r) for r in u), reverse=True):
        target = fullest_fitting(sum(len(r) for r in unit))
        if target is not None:
            for rows in unit:
                target.extend(rows)
            continue
        for rows in sorted(unit, key=len, reverse=True):
            target = fullest_fitting(len(rows))
            if target is not None:
                target.extend(rows)
                continue
            rest = list(rows)
            for b in sorted(bins, key=len):  # most room first
                take = min(size - len(b), len(rest))
                b.extend(rest[:take])
                rest = rest[take:]
                if not rest:
                    break
    return bins


def select_rows(value: Any, index: torch.Tensor) -> Any:
    """Rows ``index`` of one generation-batch entry (as TRL's shuffle/split treat them)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value if value.ndim == 0 else value[index.to(value.device)]
    if isinstance(value, (list, tuple)):
        return [value[i] for i in index.tolist()]
    return value


def chunks_of_groups(
    groups: torch.Tensor, max_rows: int, families: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Row indices of consecutive chunks of whole groups, each of at most ``max_rows`` rows
    (a larger group is one chunk), groups in first-seen order (with ``families``: a family's
    groups one after another, families in first-seen order)."""
    codes = groups.to("cpu", torch.int64)
    order = torch.argsort(codes, stable=True).tolist()
    counts = torch.bincount(codes).tolist() if codes.numel() else []
    starts = [0] * len(counts)
    for g in range(1, len(counts)):
        starts[g] = starts[g - 1] + counts[g - 1]
    group_order = list(range(len(counts)))
    if families is not None:
        fam = torch.zeros(len(counts), dtype=torch.int64)
        fam.scatter_(0, codes, families.to("cpu", torch.int64))
        group_order = torch.argsort(fam, stable=True).tolist()
    chunks: list[list[int]] = []
    current: list[int] = []
    for g in group_order:
        c = counts[g]
        rows = order[starts[g] : starts[g] + c]
        if current and len(current) + c > max_rows:
            chunks.append(current)
            current = []
        current = current + rows
    if current:
        chunks.append(current)
    return [torch.tensor(c, dtype=torch.int64) for c in chunks]
