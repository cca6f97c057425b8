"""Gradient checkpointing that keeps DualKV attention's outputs (selective activation
checkpointing), so a checkpointed layer's recompute skips the attention kernel."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _keep_attention_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if op is torch.ops.dualkv.fwd.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_kwargs(keep_attention: bool = True) -> dict[str, Any]:
    """Keyword arguments for ``torch.utils.checkpoint.checkpoint`` (transformers'
    ``gradient_checkpointing_kwargs``).

    Args:
        keep_attention: save DualKV attention's outputs (``out`` and ``lse``) in the forward, so
            the backward's recompute of a checkpointed layer runs everything but the attention
            kernel (PyTorch's selective activation checkpointing). Costs ``T * Hq * D`` elements
            of the activation dtype plus ``Hq * T`` floats per layer; saves one attention
            forward per layer and step. (As with any selective checkpointing, the graph can
            then be backpropagated once only.)

    Returns:
        ``{"use_reentrant": False}``, plus the selective-checkpoint ``context_fn`` when
        ``keep_attention``.
    """
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if keep_attention:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        kwargs["context_fn"] = functools.partial(
            create_selective_checkpoint_contexts, _keep_attention_policy
        )
    return kwargs


def enable_gradient_checkpointing(model: PreTrainedModel, keep_attention: bool = True) -> None:
    """Turn on transformers' gradient checkpointing with :func:`checkpoint_kwargs`.

    May be called again to switch ``keep_attention``. transformers raises ``ValueError`` for a
    model that does not support gradient checkpointing.

    Args:
        model: a transformers model that supports gradient checkpointing.
        keep_attention: see :func:`checkpoint_kwargs` (no effect on other attention backends).
    """
    if getattr(model, "is_gradient_checkpointing", False):
        # transformers registers its input-embedding hook again on every enable: drop the
        # previous one, so that switching the policy between steps does not stack hooks.
        disable_hooks = getattr(model, "disable_input_require_grads", None)
        if disable_hooks is not None:
            disable_hooks()
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs=checkpoint_kwargs(keep_attention)
    )
