"""The training-path API, re-exported at the package top level (``dualkv.pack``, ...).

Batch rows -> :func:`pack` -> model on the packed stream -> :func:`response_logprobs` -> the
rows' ``[B, R_max]`` log-probs -> :func:`grpo_loss` / :func:`dapo_loss`.
"""

from __future__ import annotations

from .logprobs import logprobs_from_logits, response_logprobs
from .losses import aggregate, dapo_loss, group_advantages, grpo_loss, policy_loss
from .packing import PackedBatch, pack, pack_lists, pack_rows, rows_from_lists

__all__ = [
    "PackedBatch",
    "aggregate",
    "dapo_loss",
    "group_advantages",
    "grpo_loss",
    "logprobs_from_logits",
    "pack",
    "pack_lists",
    "pack_rows",
    "policy_loss",
    "response_logprobs",
    "rows_from_lists",
]
