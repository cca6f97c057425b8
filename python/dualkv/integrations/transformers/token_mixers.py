""":func:`check_token_mixers`: the packed stream is exact for attention layers only."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from .model_parts import decoder_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel


# Token mixers the packed stream is exact for: attention only. A recurrent or convolutional
# mixer (Mamba, gated delta-net, short convolutions) would run along the packed stream, so a
# response would see the previous responses' state.
_PACKABLE_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
_SEQUENCE_MIXER_NAMES = ("Mamba", "DeltaNet", "ShortConv", "Rwkv", "Ssm", "SSM", "Recurrent")
_MIXERS_CHECKED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models scanned once


def check_token_mixers(config: Any, model: PreTrainedModel | None = None) -> None:
    """Refuse a model whose layers mix tokens by anything but attention (hybrid models).

    Checks the config's ``layer_types`` and, given the model, its decoder's modules
    (``nn.Conv1d`` and recurrent mixer classes); raises ``NotImplementedError`` naming what was
    found.
    """
    types = getattr(config, "layer_types", None)
    other = sorted(set(types or ()) - _PACKABLE_LAYER_TYPES) if isinstance(types, list) else []
    found = [f"layer types {other}"] if other else []
    if model is not None and model not in _MIXERS_CHECKED:
        for name, m in decoder_of(model).named_modules():  # (not a vision / audio tower)
            cls = type(m).__name__
            if isinstance(m, torch.nn.Conv1d) or any(x in cls for x in _SEQUENCE_MIXER_NAMES):
                found.append(f"{name} ({cls})")
                break
    if model is not None and not found:
        _MIXERS_CHECKED.add(model)
    if found:
        raise NotImplementedError(
            "DualKV packs a shared prompt for attention layers only; this model also mixes "
            f"tokens otherwise ({', '.join(found)}: a hybrid linear-attention / state-space / "
            "convolution model), which would run along the packed stream: not supported yet"
        )
