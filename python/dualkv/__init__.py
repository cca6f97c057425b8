"""DualKV: exact shared-prompt attention for RL post-training (GRPO, DAPO).

A prompt group is packed once as ``[prompt | r_1 | ... | r_N]``; :func:`attention` computes the
same function as causal attention over the N rows ``[prompt | r_i]``.
"""

from .attention import attention
from .layout import Layout
from .logprobs import logprobs_from_logits, response_logprobs
from .losses import aggregate, dapo_loss, group_advantages, grpo_loss, policy_loss
from .packing import PackedBatch, pack, pack_lists, pack_rows, rows_from_lists, rows_from_trees
from .tree_packing import pack_rows_tree

__version__ = "0.1.0"
__all__ = [
    "Layout",
    "PackedBatch",
    "__version__",
    "aggregate",
    "attention",
    "dapo_loss",
    "group_advantages",
    "grpo_loss",
    "logprobs_from_logits",
    "pack",
    "pack_lists",
    "pack_rows",
    "pack_rows_tree",
    "policy_loss",
    "response_logprobs",
    "rows_from_lists",
    "rows_from_trees",
]
