"""Micro-batches of the veRL engine (:class:`dualkv.integrations.verl.DualKVFSDPEngineWithLMHead`)
over its data-parallel ranks: prompt groups balanced over the fewest micro-batches every rank can
run, or, when the batch shares more than prompts, contiguous runs of groups in the sorted order of
their rows; the planning itself (costs, orders, cuts) is :mod:`.verl_grouping`'s."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from verl.utils.device import get_device_name

from .verl_errors import DualKVVerlError, unsupported
from .verl_grouping import GroupCosts, partition_groups, sharing_order, sharing_runs, split_runs

__all__ = ["all_reduce_int", "group_partition", "padded_rows", "sharing_partition"]


def all_reduce_int(value: int, op: Any, group: Any) -> int:
    """``value`` reduced with ``op`` over the process ``group`` (itself without a process group):
    the agreement every data-parallel rank's partition needs."""
    if not torch.distributed.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=get_device_name())
    torch.distributed.all_reduce(t, op=op, group=group)
    return int(t.item())


def _check_count(count: int, fewest_groups: int, name: str, budget: int) -> None:
    if count > fewest_groups:
        raise DualKVVerlError(
            f"DualKV engine: {name}={budget} needs {count} micro-batches, but a "
            f"data-parallel rank has only {fewest_groups} prompt groups (groups are never "
            f"split); raise {name}"
        )


def _check_largest_group(
    weights: list[int], budget: int, name: str, dp_group: Any, what: str,
    describe: Callable[[int], str],
) -> None:  # fmt: skip
    """Refuse a prompt group of more than ``budget`` packed tokens (on any dp rank), naming the
    group (``describe`` of its index on the rank that holds it) and the setting. ``what`` says
    how the tokens were counted."""
    local = max(weights, default=0)
    largest = all_reduce_int(local, torch.distributed.ReduceOp.MAX, dp_group)
    if largest <= budget:
        return
    which = (
        describe(weights.index(largest)) if local == largest
        else "a prompt group of another data-parallel rank"
    )  # fmt: skip
    raise DualKVVerlError(
        f"DualKV engine: {which} packs to {largest} tokens ({what}), more than {name}={budget}; "
        f"a group is never split across micro-batches, so raise {name} to at least {largest}"
    )


def group_partition(
    costs: list[int],
    budget: int,
    use_dynamic_bsz: bool,
    name: str,
    dp_group: Any,
    describe: Callable[[int], str],
) -> list[list[int]]:
    """Prompt groups balanced over the fewest micro-batches every dp rank can run (``describe``
    names a group in the error for one over the token budget)."""
    max_op, min_op = torch.distributed.ReduceOp.MAX, torch.distributed.ReduceOp.MIN
    num_groups = len(costs)
    if use_dynamic_bsz:
        what = "as prompt groups: its prompt plus the sum of its responses"
        _check_largest_group(costs, budget, name, dp_group, what, describe)
    fewest_groups = all_reduce_int(num_groups, min_op, dp_group)
    total = sum(costs)
    count = max(1, -(-total // budget)) if budget > 0 else num_groups
    count = all_reduce_int(min(count, max(num_groups, 1)), max_op, dp_group)
    while True:
        _check_count(count, fewest_groups, name, budget)
        bins = partition_groups(costs, budget, count, allow_oversized=not use_dynamic_bsz)
        ok = all_reduce_int(int(bins is not None), min_op, dp_group)
        if ok and bins is not None:
            return bins
        count += 1


def sharing_partition(
    prices: GroupCosts,
    rows_of: list[list[int]],
    budget: int,
    token_budget: int | None,
    name: str,
    dp_group: Any,
    describe: Callable[[int], str],
) -> list[list[int]]:
    """Groups in the sorted order of their rows (neighbours share prefixes) cut into
    contiguous runs, each within the budget in the packed tokens of its own packing (or rows,
    with a fixed micro-batch size), as many runs on every dp rank (``describe`` names a group in
    the error for one over the token budget)."""
    max_op, min_op = torch.distributed.ReduceOp.MAX, torch.distributed.ReduceOp.MIN
    order = sharing_order(prices.rows, rows_of)
    weight: Callable[[list[int]], int]
    if token_budget is not None:

        def weight(run: list[int]) -> int:
            return prices.choice(run, token_budget)[1]

        what = (
            "as a prefix tree" if prices.mode == "tree"
            else "the fewer of its prompt-group and prefix-tree packings"
        )  # fmt: skip
        weights = [weight([g]) for g in range(len(rows_of))]
        _check_largest_group(weights, budget, name, dp_group, what, describe)
    else:

        def weight(run: list[int]) -> int:
            return sum(len(rows_of[g]) for g in run)

    def fits(run: list[int]) -> bool:
        return len(run) == 1 or weight(run) <= budget

    runs = sharing_runs(order, fits)
    fewest_groups = all_reduce_int(len(order), min_op, dp_group)
    count = all_reduce_int(max(len(runs), 1), max_op, dp_group)
    _check_count(count, fewest_groups, name, budget)
    split = split_runs(runs, count, fits, weight)
    if all_reduce_int(int(split is not None), min_op, dp_group) and split is not None:
        return split
    raise DualKVVerlError(
        f"DualKV engine: {name}={budget} needs {count} micro-batches on every data-parallel "
        f"rank, but a rank's prompt groups cannot be cut into {count} within {name}; raise {name}"
    )


def padded_rows(data: Any) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """veRL's no-padding rows back in its padded layout: ``(input_ids, attention_mask,
    prompt_width, position_ids)``, each ``[B, Pw + Rw]`` (left-padded prompt, right-padded
    response), what the packers take."""
    input_ids = data["input_ids"]
    position_ids = data["position_ids"]
    if not input_ids.is_nested or position_ids.dim() != 2:
        raise unsupported("position ids that are not one per token (3-D / mRoPE)")
    prompts = data["prompts"]
    mask = data["attention_mask"].to(input_ids.device)
    if prompts.is_nested or mask.is_nested:
        raise unsupported("nested 'prompts' or 'attention_mask'")
    real = mask != 0
    values = input_ids.values()
    if int(real.sum()) != values.numel():
        raise DualKVVerlError(
            f"DualKV engine: attention_mask has {int(real.sum())} real tokens but input_ids "
            f"has {values.numel()}; the rows cannot be packed"
        )
    rows = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    rows[real] = values
    pos = torch.zeros(mask.shape, dtype=torch.int64, device=values.device)
    pos[real] = position_ids.values().to(torch.int64)
    return rows, mask, prompts.shape[1], pos
