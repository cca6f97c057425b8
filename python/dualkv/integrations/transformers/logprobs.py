"""Response log-probs of a transformers causal LM: on a packed batch, on the standard rows (the
unshared path, for comparison), and sequence-parallel."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from ... import parallel
from ...logprobs import logprobs_from_logits, response_logprobs
from ...packing import PackedBatch
from .model_guards import check_packed_model
from .model_parts import decoder_of, lm_head_of, text_config_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def packed_hidden_states(
    model: PreTrainedModel, packed: PackedBatch, **kwargs: Any
) -> torch.Tensor:
    """Final hidden states ``[1, T, H]`` of a causal LM's decoder on a packed batch.

    The model must use ``attn_implementation="dualkv"``; ``kwargs`` go to the decoder's forward.
    """
    check_packed_model(model, kwargs, packed)
    if packed.total_tokens == 0:  # (an empty batch: transformers' forward cannot run on 0 tokens)
        embed = cast(torch.Tensor, model.get_input_embeddings().weight)
        return embed.new_zeros(1, 0, text_config_of(model).hidden_size)
    out = decoder_of(model)(**packed.model_inputs(), **kwargs)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def packed_response_logprobs(
    model: PreTrainedModel,
    packed: PackedBatch,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    **kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Response log-probs ``[B, R_max]`` (and entropy) of a causal LM on a packed batch.

    Runs the decoder on the packed stream (``"dualkv"`` attention), then the chunked
    :func:`dualkv.response_logprobs` with the model's LM head (and Gemma's final logit
    soft-capping when configured). ``kwargs`` go to the decoder's forward.
    """
    hidden = packed_hidden_states(model, packed, **kwargs)
    weight, bias, softcap = lm_head_of(model)
    return response_logprobs(
        hidden, weight, packed, temperature=temperature, return_entropy=return_entropy,
        lm_head_bias=bias, logit_softcap=softcap, chunk_size=chunk_size,
    )  # fmt: skip


def rows_response_logprobs(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The standard (unshared) path: response log-probs ``[B, R_max]`` of trainer rows.

    Runs ``model`` (any attention implementation, e.g. ``"sdpa"``) on the ``[B, L]`` rows with
    their padding mask and positions (``cumsum(mask) - 1`` by default), takes the full-vocabulary
    logits of the response-predicting positions and their log-softmax, as a trainer does without
    DualKV. Zeros on padding.
    """
    mask = attention_mask.to(torch.int64)
    if position_ids is None:
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    width = input_ids.shape[1]
    rw = width - int(prompt_width)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        logits_to_keep=rw + 1,
    )
    logits = out.logits[:, -(rw + 1) : -1]
    labels = input_ids[:, prompt_width:]
    return logprobs_from_logits(
        logits, labels, attention_mask[:, prompt_width:] != 0, temperature, return_entropy
    )


def sequence_parallel_logprobs(
    model: PreTrainedModel,
    packed: PackedBatch,
    group: Any = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    grad_scale: float = 1.0,
    pad_id: int = 0,
    **kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Response log-probs ``[B, R_max]`` (and entropy) of a HF causal LM with
    ``attn_implementation="dualkv"``, the packed batch sharded over ``group``.

    The entry point for trainers (e.g. veRL's ``ulysses_sequence_parallel_size``): every rank of
    the SP group calls it with the same global ``packed`` batch; each runs the decoder on its
    shard, and every rank returns the global log-probs (see
    :func:`dualkv.parallel.response_logprobs` for ``grad_scale`` and the gradients). ``kwargs`` go
    to the decoder's forward.
    """
    check_packed_model(model, kwargs, packed)
    batch = parallel.shard_batch(packed, group, pad_id=pad_id)
    out = decoder_of(model)(**batch.model_inputs(), **kwargs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    weight, bias, softcap = lm_head_of(model)
    return parallel.response_logprobs(
        hidden, weight, batch, temperature=temperature, return_entropy=return_entropy,
        lm_head_bias=bias, logit_softcap=softcap, chunk_size=chunk_size, grad_scale=grad_scale,
    )  # fmt: skip
