"""Group-aware micro-batching of the veRL engine (:mod:`dualkv.integrations.verl`): rows grouped
by their prompt, whole groups assigned to balanced micro-batches. Host work, once per batch; no
veRL import."""

from __future__ import annotations

import torch

from ..trainer_rows import prompt_group_codes


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
