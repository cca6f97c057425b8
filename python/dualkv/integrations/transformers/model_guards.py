"""What a model must be for a packed forward (:func:`check_packed_model`): the ``"dualkv"``
attention, text-only inputs, a decoder that takes the packed positions, and no term that
depends on the packed stream's length or index (length-dependent RoPE, Llama 4's attention
temperature, a multimodal model's media tokens). Each refusal names what was found."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

from ...packing import PackedBatch
from .attention_backend import ATTN_IMPLEMENTATION
from .model_parts import decoder_of, text_config_of
from .token_mixers import check_token_mixers

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def check_packed_model(
    model: PreTrainedModel,
    kwargs: dict[str, Any],
    packed: PackedBatch | None = None,
    decoder: torch.nn.Module | None = None,
) -> None:
    """What every packed forward of ``model``'s decoder (with keywords ``kwargs``, on ``packed``
    when given) needs: the ``"dualkv"`` attention, attention-only token mixers, no multimodal
    input, a decoder that takes the packed positions, no position-dependent term the packed
    stream would change (length-dependent RoPE, Llama 4's attention temperature), and no media
    placeholder token that a multimodal model's forward would embed otherwise than its text
    decoder. ``decoder``: the module the packed forward runs, when not the text decoder (TRL's
    trainer runs ``model.base_model``, which embeds those tokens as the model does)."""
    config = text_config_of(model)
    impl = getattr(config, "_attn_implementation", None)
    if impl != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"the model uses attn_implementation={impl!r}; load it with "
            'attn_implementation="dualkv"'
            ' or call model.set_attn_implementation("dualkv")'
        )
    check_token_mixers(config, model)
    refuse_multimodal(kwargs, "the packed forward")
    model_type = getattr(config, "model_type", None)
    if model_type in _OWN_ATTENTION_MODEL_TYPES:
        raise NotImplementedError(
            f"{model_type}: its text layers compute attention themselves "
            f"({_OWN_ATTENTION_MODEL_TYPES[model_type]}) instead of through the attention "
            "implementation, so they would attend over the whole packed stream; not supported yet"
        )
    text_decoder = decoder_of(model)
    if not _takes_position_ids(text_decoder):
        raise NotImplementedError(
            f"{type(text_decoder).__name__} takes no position_ids (it numbers its tokens 0..T-1 "
            "itself), so packed responses would get their place in the stream as absolute "
            "positions; not supported yet"
        )
    if packed is not None and packed.total_tokens > 0:
        check_rope_length(model, lambda: int(packed.position_ids.max()) + 1, "the packed stream")
        _check_attention_temperature(config, packed.total_tokens)
        if decoder is None or decoder is text_decoder:
            _check_media_tokens(model, packed.input_ids)


# The placeholder tokens of a multimodal model's images, videos and audio (the ids in its config).
# Its own forward embeds them otherwise than its text decoder does, even without the media (Gemma
# 4 gives them the pad token's embedding and per-layer inputs, Gemma 3n its media embedders'),
# while the packed forward runs the text decoder alone.
_MEDIA_TOKEN_ATTRS = (
    "image_token_id",
    "image_token_index",
    "video_token_id",
    "video_token_index",
    "audio_token_id",
    "audio_token_index",
)


def _check_media_tokens(model: PreTrainedModel, input_ids: torch.Tensor) -> None:
    """Refuse a packed batch of a multimodal model (a config with a text config of its own) that
    holds one of its image / video / audio placeholder tokens, or a token of its media
    vocabularies (``vocab_offset`` of its vision / audio config, Gemma 3n): the model's forward
    would not embed it as its text decoder does (one host synchronisation, for such models only;
    an assert in the graph under torch.compile)."""
    config = model.config
    text_config = text_config_of(model)
    if config is text_config:
        return
    ids = sorted(
        {v for a in _MEDIA_TOKEN_ATTRS if isinstance(v := getattr(config, a, None), int) and v >= 0}
    )
    offsets = [
        getattr(getattr(config, sub, None), "vocab_offset", None)
        for sub in ("vision_config", "audio_config")
    ]
    first = min((o for o in offsets if isinstance(o, int) and o >= 0), default=None)
    if not ids and first is None:
        return
    flat = input_ids.reshape(-1)
    found = torch.zeros_like(flat, dtype=torch.bool)
    if ids:
        found |= torch.isin(flat, torch.tensor(ids, device=flat.device, dtype=flat.dtype))
    if first is not None:
        found |= flat >= first
    named = [
        f"{a}={getattr(config, a)}" for a in _MEDIA_TOKEN_ATTRS if getattr(config, a, None) in ids
    ]
    if first is not None:
        named.append(f"media vocabularies from {first}")
    msg = (
        "the packed batch holds image / video / audio placeholder tokens of "
        f"{type(model).__name__} ({', '.join(named)}): the model's own forward embeds them "
        "otherwise than its text decoder, which the packed forward runs (Gemma 4, without the "
        "media: as the pad token); not supported yet"
    )
    if torch.compiler.is_compiling():
        torch._assert_async(~found.any(), msg)
        return
    if bool(found.any()):
        seen = sorted(set(flat[found].tolist()))
        raise NotImplementedError(f"{msg} (ids found: {seen[:8]})")


# Causal LMs whose text layers compute attention themselves (not through transformers' attention
# interface, so "dualkv" would only drop their mask), and the module that does.
_OWN_ATTENTION_MODEL_TYPES = {"git": "GitSelfAttention"}


_TAKES_POSITION_IDS: dict[type, bool] = {}


def _takes_position_ids(decoder: torch.nn.Module) -> bool:
    cls = type(decoder)
    if cls not in _TAKES_POSITION_IDS:
        _TAKES_POSITION_IDS[cls] = "position_ids" in inspect.signature(cls.forward).parameters
    return _TAKES_POSITION_IDS[cls]


def _length_dependent_ropes(config: Any) -> list[tuple[str, int]]:
    """``(rope_type, length)`` for each RoPE of ``config`` whose frequencies change once the
    positions reach ``length`` (transformers' ``dynamic`` and ``longrope``: they take the
    frequencies from the batch's largest position)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict) or not params:
        return []
    per_type = all(isinstance(v, dict) for v in params.values())
    found = []
    for p in params.values() if per_type else [params]:
        kind = str(p.get("rope_type", p.get("type", "default")))
        if "dynamic" in kind:
            found.append((kind, int(getattr(config, "max_position_embeddings", 0) or 0)))
        elif kind == "longrope":
            limit = p.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None
            )
            found.append((kind, int(limit or getattr(config, "max_position_embeddings", 0) or 0)))
    return found


def check_rope_length(model: PreTrainedModel, length: Any, what: str) -> None:
    """Raise ``NotImplementedError`` when ``model`` has a RoPE whose frequencies depend on the
    batch's length and ``length()`` (positions + 1 of ``what``; called only for such a model)
    is past the length where they change: the packed stream and the rows it stands for would
    get different frequencies. Below it, such a RoPE is the plain one."""
    ropes = _length_dependent_ropes(text_config_of(model))
    if not ropes:
        return
    n = int(length())
    for kind, limit in ropes:
        if n > limit:
            raise NotImplementedError(
                f"{kind!r} RoPE scaling changes its frequencies with the batch's largest "
                f"position beyond {limit} tokens, and {what} reaches {n}: the packed stream and "
                "the rows would use different frequencies; not supported yet"
            )


def _position_scaled_queries(config: Any) -> bool:
    """Whether ``config``'s attention scales the queries by their absolute position (Ministral 3's
    and Mistral 4's ``llama_4_scaling_beta``: ``1 + beta log(1 + floor(pos / original_max))``)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return False
    per_type = params.values() if all(isinstance(v, dict) for v in params.values()) else [params]
    return any(float(p.get("llama_4_scaling_beta") or 0.0) != 0.0 for p in per_type)


def relative_positions_only(model: PreTrainedModel) -> bool:
    """Whether ``model`` reads positions only through a rotary embedding of fixed frequencies, so
    shifting all of a row's positions by one constant leaves its outputs unchanged (up to the
    rounding of the rotary angles): its text decoder computes a ``rotary_emb``, holds no embedding
    table besides the token embeddings (GPT-2's and OPT's learned positions are one), has no
    length-dependent RoPE and no position-dependent attention temperature or query scale.
    Conservative: False for anything else (ALiBi, sinusoidal or per-layer embeddings too)."""
    config = text_config_of(model)
    decoder = decoder_of(model)
    if not isinstance(getattr(decoder, "rotary_emb", None), torch.nn.Module):
        return False
    if _length_dependent_ropes(config) or getattr(config, "attn_temperature_tuning", False):
        return False
    if _position_scaled_queries(config):
        return False
    tokens = model.get_input_embeddings()
    return all(m is tokens for m in decoder.modules() if isinstance(m, torch.nn.Embedding))


def _check_attention_temperature(config: Any, total_tokens: int) -> None:
    """Llama 4's NoPE layers scale queries by their index in the sequence once it reaches
    ``floor_scale``: the packed stream's index, not the token's position in its row."""
    if not getattr(config, "attn_temperature_tuning", False):
        return
    floor = int(getattr(config, "floor_scale", 0) or 0)
    nope = getattr(config, "no_rope_layers", None) or []
    layers = int(getattr(config, "num_hidden_layers", len(nope)))
    if any(v == 0 for v in list(nope)[:layers]) and total_tokens + 1 > floor:
        raise NotImplementedError(
            f"attn_temperature_tuning scales the NoPE layers' queries by the token's index once "
            f"it reaches floor_scale={floor}; a packed stream of {total_tokens} tokens would use "
            "its own index instead of each row's: not supported yet"
        )


# Image / video / audio inputs of transformers' multimodal models (and the token types that mark
# their tokens). The packed forward runs the text decoder, which would take them in **kwargs and
# ignore them.
MULTIMODAL_ARGS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
_MULTIMODAL_PREFIXES = ("pixel_", "image_", "video_", "audio_", "input_features")


def refuse_multimodal(kwargs: dict[str, Any], where: str) -> None:
    """Raise ``NotImplementedError`` for a multimodal input in ``kwargs`` that is not None."""
    for name, value in kwargs.items():
        if value is not None and (name in MULTIMODAL_ARGS or name.startswith(_MULTIMODAL_PREFIXES)):
            raise NotImplementedError(
                f"{where} packs text only: {name!r} (a multimodal input) is not supported yet"
            )
