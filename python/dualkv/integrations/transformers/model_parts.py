"""Where a transformers causal LM keeps what the packed path runs: its decoder stack, its text
config, its LM head (with the final logit soft-capping its forward applies)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def decoder_of(model: PreTrainedModel) -> torch.nn.Module:
    """The decoder stack of a causal LM (what returns the final hidden states)."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    if decoder is None or decoder is model:
        decoder = getattr(model, "model", None)
    if not isinstance(decoder, torch.nn.Module):
        decoder = getattr(model, "base_model", model)
    assert isinstance(decoder, torch.nn.Module)
    return decoder


def text_config_of(model: PreTrainedModel) -> Any:
    """The config of the model's text decoder (a multimodal model's text config; else the
    model's config)."""
    config = model.config
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def _logit_scale(text_config: Any) -> float:
    """The multiplier a model applies to its logits before any soft-capping (1.0 for most)."""
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        scaling = text_config.logits_scaling
        scale = scaling if text_config.model_type == "hyperclovax" else 1 / scaling
    return 1.0 if scale is None else float(scale)


def lm_head_softcap(model: PreTrainedModel) -> float | None:
    """The final logit soft-capping the packed LM head applies (Gemma's), or None.

    The text config's ``final_logit_softcapping``, where the model's forward applies it: a class
    whose forward never reads it (Gemma 3's ``Gemma3ForConditionalGeneration``, although its
    text config has the field) computes its logits without the cap, and so does the packed head.

    Raises ``NotImplementedError`` for a model that scales its logits (Cohere's ``logit_scale``,
    Granite's ``logits_scaling``, ...): scoring them unscaled would be a silent wrong answer.
    """
    text_config = text_config_of(model)
    scale = _logit_scale(text_config)
    if scale != 1.0:
        raise NotImplementedError(
            f"{type(model).__name__} scales its logits by {scale} (logit_scale / logits_scaling "
            "in its config); DualKV's packed LM head does not support logit scaling yet"
        )
    softcap = getattr(text_config, "final_logit_softcapping", None)
    if softcap and not _forward_reads(model, "final_logit_softcapping"):
        return None
    return softcap


_FORWARD_READS: dict[tuple[type, str], bool] = {}


def _forward_reads(model: Any, name: str) -> bool:
    """Whether the forward of ``model``'s class (any ``forward`` in its MRO, as defined by a
    transformers model) reads the attribute ``name``; True when that cannot be told (a wrapper
    that is not a transformers model, a forward that is not Python code), so that only a
    transformers model whose every forward is known not to read it counts as not reading it."""
    from transformers import PreTrainedModel

    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: the model it wraps
    get_base = getattr(model, "get_base_model", None)  # a PEFT wrapper: the model it wraps
    if not isinstance(model, PreTrainedModel) and callable(get_base):
        model = get_base()
    if not isinstance(model, PreTrainedModel):
        return True
    cls = type(model)
    key = (cls, name)
    if key not in _FORWARD_READS:
        reads = False
        for klass in cls.__mro__:
            fn = vars(klass).get("forward")
            if fn is None:
                continue
            code = getattr(inspect.unwrap(fn), "__code__", None)
            if code is None or name in _code_names(code):
                reads = True
                break
        _FORWARD_READS[key] = reads
    return _FORWARD_READS[key]


def _code_names(code: Any) -> set[str]:
    """The attribute and global names a code object (and the functions defined in it) uses."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def lm_head_of(model: PreTrainedModel) -> tuple[torch.Tensor, torch.Tensor | None, float | None]:
    """``(weight, bias, final logit softcap)`` of the model's LM head, for
    :func:`dualkv.response_logprobs` (the softcap as :func:`lm_head_softcap`)."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (LM head)")
    return head.weight, getattr(head, "bias", None), lm_head_softcap(model)
