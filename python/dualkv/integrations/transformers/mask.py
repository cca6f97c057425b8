"""The mask function of ``"dualkv"`` (transformers' mask interface): the layout is the mask, so
none is built; what a mask would carry that the layout cannot (padding, bidirectional blocks) is
refused."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class LocalMask:
    """What ``"dualkv"``'s mask function returns for a sliding-window or chunked mask of ``size``
    tokens that matters on the batch: the attention function checks that the layer applies the
    same window (a window dropped there would be a silent wrong answer)."""

    size: int

    def __getitem__(self, index: object) -> LocalMask:
        """Gemma 4 (transformers 5.25) slices every mask by query rows before its KV-shared layers
        (``mask[:, :, rows, :]``, for ``logits_to_keep``): the marker stays the batch's mask, and
        the attention function refuses a query shorter than the layout's stream."""
        return self


def dualkv_mask(
    *args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any
) -> LocalMask | None:
    """Mask function of ``"dualkv"`` (transformers' mask interface): no mask, the layout is it
    (or a :class:`LocalMask` for a window that the layers' attention must apply).

    A padding mask with zeros cannot be honoured on a packed stream (there is no padding in
    it), so it is refused rather than ignored; an all-ones mask is accepted (checked with one
    host synchronisation; under torch.compile only ``None`` is accepted).

    For a model that may relax causality among vision tokens (Gemma 4 with
    ``use_bidirectional_attention="vision"``), the mask function transformers built is checked
    on every (token, next token) pair: a bidirectional block (an image's or video's tokens)
    raises, since the layout cannot express it and dropping it would be a silent wrong answer.
    """
    config = kwargs.get("config")
    mask_function = kwargs.get("mask_function")
    kv_length = int(kwargs.get("kv_length") or 0)
    bidirectional = getattr(config, "use_bidirectional_attention", None)
    relaxed = (
        bidirectional == "vision"
        or bool(kwargs.get("use_vmap"))  # (transformers' flag for or / and overlays)
        or (not torch.compiler.is_compiling() and _has_or_overlay(mask_function))
    )
    if mask_function is not None and relaxed:
        _check_causal(mask_function, kv_length, kwargs.get("device"))
    if not torch.compiler.is_compiling():
        _check_positions_length(sys._getframe(1), kwargs.get("q_length"))
    # A sliding-window or chunked mask (transformers passes its size as local_size) matters when
    # it is shorter than the stream (logical distances are below T): the layer's attention must
    # then apply that window itself, which dualkv_attention_forward checks. The attention decides
    # against the layout's stream: under sequence parallelism kv_length here is one rank's shard
    # (a window between the shard's and the stream's length matters, yet passed this length test).
    local = kwargs.get("local_size")
    marker = LocalMask(int(local)) if local is not None else None
    if attention_mask is None or kwargs.get("batch_size", 1) != 1:
        return marker  # (rows, not one packed stream: the attention function refuses them)
    if torch.compiler.is_compiling():
        raise ValueError(
            'attn_implementation="dualkv" takes its mask from the layout: call the model with '
            "attention_mask=None on a packed batch"
        )
    if not bool(attention_mask.all()):
        raise ValueError(
            'attn_implementation="dualkv" got an attention_mask with zeros (padding): a packed '
            "batch has no padding, its mask is the layout. Pack the rows with "
            "dualkv.pack(input_ids, attention_mask, prompt_width) and call the model with "
            "attention_mask=None"
        )
    return marker


def _has_or_overlay(mask_function: Any, depth: int = 0) -> bool:
    """Whether transformers composed ``mask_function`` with an ``or_masks`` overlay anywhere
    (e.g. Gemma 3's two-way image blocks through ``block_sequence_ids``): a mask that may let a
    token see later ones. Reads the closures only (no device work)."""
    if not callable(mask_function) or depth > 8:
        return False
    if getattr(mask_function, "__name__", "") == "or_mask":
        return True
    for cell in getattr(mask_function, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        inner = value if isinstance(value, tuple | list) else (value,)
        if any(_has_or_overlay(f, depth + 1) for f in inner):
            return True
    return False


def _check_positions_length(caller: Any, q_length: Any) -> None:
    """Refuse position ids of another length than the packed stream, before the model's RoPE
    fails on them with a broadcasting error: the mask function is the only ``"dualkv"`` code that
    runs before RoPE, called by transformers' mask factory (``caller``, its frame), which holds
    the model's ``position_ids``. Reads local variables only (no device work)."""
    if caller is None or caller.f_globals.get("__name__") != "transformers.masking_utils":
        return
    pos = caller.f_locals.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.dim() and q_length is not None:
        if pos.shape[-1] != int(q_length):
            raise ValueError(
                f"position_ids has {pos.shape[-1]} positions per row but the packed stream has "
                f"{int(q_length)} tokens: pass position_ids of shape [1, {int(q_length)}], the "
                "packed batch's (packed.position_ids; model(**packed.model_inputs()) passes them)"
            )


def _check_causal(mask_function: Any, length: int, device: Any) -> None:
    if length < 2:
        return
    q = torch.arange(length - 1, device=device)
    zero = torch.zeros_like(q)
    sees_next = torch.as_tensor(mask_function(zero, zero, q, q + 1))
    if bool(sees_next.any()):  # one host sync per mask, only for such models
        raise ValueError(
            "dualkv attention is causal, but this batch's mask lets tokens attend to later ones "
            "(bidirectional attention: among image / video tokens with Gemma 3 or PaliGemma "
            "token_type_ids or Gemma 4 use_bidirectional_attention='vision', or over the whole "
            "text with Gemma 3 use_bidirectional_attention=True); packing such batches is not "
            "supported yet"
        )
