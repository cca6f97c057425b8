"""Group-aware micro-batching of the veRL engine (:mod:`dualkv.integrations.verl`): rows grouped
by their prompt, whole groups assigned to micro-batches, and each micro-batch's packing (prompt
groups or prefix tree). Host work, once per batch; no veRL import.

Two partitions:

* :func:`partition_groups` (ordinary GRPO batches, where rows share their prompt and nothing
  more): groups balanced over the micro-batches, longest first, costs in prompt-group packed
  tokens ``P + sum R``.
* :func:`sharing_runs` (batches whose rows share more: a system prompt across groups, the
  earlier turns of per-turn samples): the groups in the sorted order of their rows, so that
  neighbours share prefixes, cut into contiguous runs, each priced exactly in the packed tokens
  of the packing it will run (:class:`GroupCosts`).

:func:`use_tree` is the one rule that picks the packing of a set of rows, and
:func:`use_sharing_partition` the one that picks the partition of a batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..prefix_forest import SortedRows, forest_tokens
from ..trainer_rows import prompt_group_codes
from ..tree_packing import DEFAULT_MIN_SHARED, tree_saves

# The setting that forces either packing (an environment variable of the training processes, as
# veRL's own VERL_* switches): "auto" (default; the rule of use_tree), "tree" (every micro-batch a
# prefix tree) or "groups" (prompt groups only: the engine as before prefix trees).
PACKING_ENV = "DUALKV_VERL_PACKING"
PACKING_MODES = ("auto", "tree", "groups")


def prompt_groups(
    prompts: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group rows by their real prompt tokens.

    Args:
        prompts: ``[B, Pw]`` left-padded prompt ids (veRL's ``prompts``).
        attention_mask: ``[B, Pw + Rw]`` veRL's padded attention mask.

    Returns:
        ``(group [B], prompt_len [B], response_len [B])`` on the CPU: ``group`` numbers the
        distinct prompts in first-seen order.
    """
    pw = prompts.shape[1]
    mask = attention_mask.detach().to("cpu") != 0
    plen = mask[:, :pw].sum(1)
    rlen = mask[:, pw:].sum(1)
    group = prompt_group_codes(prompts.detach().to("cpu"), mask[:, :pw])
    return group, plen, rlen


def partition_groups(
    costs: list[int],
    budget: int,
    num_bins: int,
    allow_oversized: bool,
) -> list[list[int]] | None:
    """Balanced assignment of groups to ``num_bins`` micro-batches (longest first).

    Args:
        costs: cost of each group (packed tokens, or rows).
        budget: the most a micro-batch may cost.
        num_bins: number of micro-batches.
        allow_oversized: a group costing more than the budget may be a micro-batch alone.

    Returns:
        For each bin, its group indices in increasing order; None when the groups do not fit.
    """
    if num_bins < 1 or num_bins > len(costs):
        return None
    order = sorted(range(len(costs)), key=lambda g: (-costs[g], g))
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    for g in order:
        b = min(range(num_bins), key=lambda i: (loads[i], i))
        bins[b].append(g)
        loads[b] += costs[g]
    for b in range(num_bins):
        if loads[b] > budget and not (allow_oversized and len(bins[b]) == 1):
            return None
        if not bins[b]:
            return None
    return [sorted(b) for b in bins]


def packing_mode(value: str | None) -> str:
    """The packing mode named by :data:`PACKING_ENV`'s value (None or empty: ``"auto"``)."""
    mode = (value or "auto").strip().lower()
    if mode not in PACKING_MODES:
        raise ValueError(
            f"{PACKING_ENV}={value!r}: expected one of {', '.join(PACKING_MODES)} (auto: a prefix "
            "tree where it packs clearly fewer tokens than prompt groups)"
        )
    return mode


def use_tree(mode: str, flat: int, tree: int, budget: int | None = None) -> bool:
    """Whether rows packing to ``flat`` tokens as prompt groups and ``tree`` tokens as a prefix
    tree run as the tree: in ``"auto"`` mode when it saves
    :data:`dualkv.tree_packing.TREE_MIN_SAVING` of the tokens
    (:func:`dualkv.tree_packing.tree_saves`), or saves any when only the tree fits the token
    ``budget``."""
    if mode != "auto":
        return mode == "tree"
    if tree >= flat:
        return False
    return tree_saves(flat, tree) or (budget is not None and flat > budget)


class GroupCosts:
    """Packed tokens of sets of prompt groups under both packings.

    Args:
        rows: the batch's :class:`dualkv.prefix_forest.SortedRows` (keys as the tree packing's).
        rows_of: each group's rows.
        flat: each group's prompt-group packed tokens (``P + sum R``).
        mode: a :data:`PACKING_MODES` entry.
        min_shared: the tree packing's shortest shared segment.
    """

    def __init__(
        self,
        rows: SortedRows,
        rows_of: Sequence[Sequence[int]],
        flat: Sequence[int],
        mode: str,
        min_shared: int = DEFAULT_MIN_SHARED,
    ) -> None:
        self.rows, self.rows_of, self.flat_costs = rows, rows_of, flat
        self.mode, self.min_shared = mode, min_shared

    def flat(self, groups: Sequence[int]) -> int:
        return sum(self.flat_costs[g] for g in groups)

    def tree(self, groups: Sequence[int]) -> int:
        members = [b for g in groups for b in self.rows_of[g]]
        return forest_tokens(self.rows, members, self.min_shared)

    def choice(self, groups: Sequence[int], budget: int | None = None) -> tuple[bool, int]:
        """``(tree?, packed tokens)`` of the packing :func:`use_tree` picks for these groups."""
        flat = self.flat(groups)
        tree = self.tree(groups) if self.mode != "groups" else flat
        chosen = use_tree(self.mode, flat, tree, budget)
        return chosen, tree if chosen else flat


def use_sharing_partition(prices: GroupCosts, token_budget: int | None) -> bool:
    """Whether a batch is cut by the tree-aware partition (:func:`sharing_runs`, each run priced
    in the packing it runs) rather than the balanced prompt-group one (:func:`partition_groups`,
    which prices every group in prompt-group tokens).

    ``"tree"`` mode: always; ``"groups"``: never. ``"auto"``: when the whole batch's prefix tree
    saves :data:`dualkv.tree_packing.TREE_MIN_SAVING` of the tokens, or when a prompt group
    exceeds the ``token_budget`` (dynamic batch size) as prompt groups but packs to fewer tokens
    as a tree (rows sharing long prefixes beyond their prompt): the balanced partition would
    refuse that group, the tree-aware one runs it as a tree, or names the tree's tokens when even
    they exceed the budget.
    """
    if prices.mode != "auto":
        return prices.mode == "tree"
    every = range(len(prices.rows_of))
    if use_tree("auto", prices.flat(every), prices.tree(every)):
        return True
    if token_budget is None:
        return False
    return any(
        prices.choice([g], token_budget)[0] for g in every if prices.flat_costs[g] > token_budget
    )


def sharing_order(rows: SortedRows, rows_of: Sequence[Sequence[int]]) -> list[int]:
    """Groups in the sorted order of their first row (in lexicographic row order): groups whose
    rows share prefixes are neighbours (a system prompt's groups; the turns of one trajectory,
    each turn's row a prefix of the next)."""
    return sorted(
        range(len(rows_of)),
        key=lambda g: (min((rows.row_of[b] for b in rows_of[g]), default=-1), g),
    )


def sharing_runs(order: Sequence[int], fits: Callable[[list[int]], bool]) -> list[list[int]]:
    """Cut ``order`` into contiguous runs, each as long as ``fits`` allows (greedy).

    Runs grow by doubling, then a binary search (``O(log k)`` calls for a run of ``k`` groups).
    Every run of two groups or more was tested with ``fits``; a group alone is always taken (the
    caller checks single groups first). The run is the longest that fits when ``fits`` is
    downward closed, as the packed token counts of prompt groups and prefix trees are (fewer rows
    never pack to more tokens: ``test_fewer_rows_never_pack_to_more_tokens``).
    """
    runs: list[list[int]] = []
    start, n = 0, len(order)
    while start < n:
        good, step = 1, 1  # order[start:start + good] fits
        bad = n - start + 1  # and order[start:start + bad] does not (or runs past the end)
        while start + good < n:
            trial = min(good + step, n - start)
            if not fits(list(order[start : start + trial])):
                bad = trial
                break
            good, step = trial, step * 2
        while bad - good > 1:
            mid = (good + bad) // 2
            if fits(list(order[start : start + mid])):
                good = mid
            else:
                bad = mid
        runs.append(list(order[start : start + good]))
        start += good
    return runs


def split_runs(
    runs: list[list[int]],
    count: int,
    fits: Callable[[list[int]], bool],
    weight: Callable[[list[int]], int],
) -> list[list[int]] | None:
    """``runs`` cut further into exactly ``count`` runs: the heaviest run that can be cut into
    two parts that both fit is cut where the parts' weights are closest, until there are
    ``count`` runs (None when no run can be cut)."""
    runs = [list(r) for r in runs]
    while len(runs) < count:
        best: tuple[int, int, int] | None = None  # (-run weight, run, cut)
        for i in sorted(range(len(runs)), key=lambda j: (-weight(runs[j]), j)):
            run = runs[i]
            cuts = [
                (abs(weight(run[:c]) - weight(run[c:])), c)
                for c in range(1, len(run))
                if fits(run[:c]) and fits(run[c:])
            ]
            if cuts:
                best = (-weight(run), i, min(cuts)[1])
                break
        if best is None:
            return None
        _, i, cut = best
        runs[i : i + 1] = [runs[i][:cut], runs[i][cut:]]
    return runs
