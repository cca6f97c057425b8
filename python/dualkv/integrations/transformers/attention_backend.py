"""The ``"dualkv"`` attention implementation of transformers: the attention function, how the
batch's layout reaches it (the ``dualkv_layout`` keyword, :func:`use_layout`), and
:func:`register`, which adds it to transformers' interfaces and makes every other implementation
refuse a packed batch."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..._autocast import autocast_inputs
from ...attention import attention
from ...layout import Layout
from ...parallel import ShardedLayout, ulysses_attention
from .mask import LocalMask, dualkv_mask
from .model_parts import decoder_of
from .positions import check_positions
from .token_mixers import check_token_mixers

if TYPE_CHECKING:
    from transformers import PreTrainedModel


ATTN_IMPLEMENTATION = "dualkv"
LAYOUT_KWARG = "dualkv_layout"
DETERMINISTIC_KWARG = "dualkv_deterministic"

# Process-wide (not thread-local: the autograd engine may replay a checkpointed layer on its
# device thread) stack of (layout, deterministic) set by use_layout().
_LAYOUT_STACK: list[tuple[Layout | ShardedLayout, bool]] = []


def current_layout() -> Layout | ShardedLayout | None:
    """The innermost layout set by :func:`use_layout`, or None."""
    return _LAYOUT_STACK[-1][0] if _LAYOUT_STACK else None


@contextlib.contextmanager
def use_layout(
    layout: Layout | ShardedLayout,
    model: PreTrainedModel | None = None,
    deterministic: bool = False,
) -> Iterator[Layout | ShardedLayout]:
    """Make ``layout`` the layout of ``"dualkv"`` attention inside the ``with`` block.

    Args:
        layout: the packed batch's :class:`dualkv.Layout` (or, sequence-parallel, this rank's
            :class:`dualkv.parallel.ShardedLayout`).
        model: optional model; when given, a forward pre-hook adds ``dualkv_layout=layout`` to
            its decoder's forward keywords, so gradient-checkpointed layers replay with it even
            when the backward runs after the block.
        deterministic: bitwise-reproducible attention gradients.
    """
    if not isinstance(layout, (Layout, ShardedLayout)):
        raise TypeError(
            "layout must be a dualkv.Layout (or a dualkv.parallel.ShardedLayout), got "
            f"{type(layout).__name__}"
        )
    handle = None
    if model is not None:

        def hook(
            module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            kwargs.setdefault(LAYOUT_KWARG, layout)
            if deterministic:
                kwargs.setdefault(DETERMINISTIC_KWARG, True)
            return args, kwargs

        # on the decoder (base model): it sees the keyword whether the caller runs the causal LM
        # or the decoder alone
        target = decoder_of(model)
        handle = target.register_forward_pre_hook(hook, with_kwargs=True)
    _LAYOUT_STACK.append((layout, deterministic))
    try:
        yield layout
    finally:
        _LAYOUT_STACK.pop()
        if handle is not None:
            handle.remove()


def dualkv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention function of ``attn_implementation="dualkv"`` (transformers' interface).

    Args:
        module: the calling attention module.
        query: ``[1, Hq, T, D]``; key, value: ``[1, Hkv, T, D]`` on the packed stream.
        attention_mask: None (the layout is the mask), or the :class:`LocalMask` marker of
            :func:`dualkv_mask` for a sliding-window / chunked mask, which must match
            ``sliding_window`` where it is shorter than the stream.
        dropout: must be 0 (attention dropout is not supported).
        scaling: softmax scale (default ``1/sqrt(D)``).
        sliding_window: the layer's window in logical positions (``pos(q) - pos(k) < w``).
        softcap: attention logit soft-capping (Gemma 2 style), None for none.
        kwargs: ``dualkv_layout`` (else :func:`current_layout`): a :class:`dualkv.Layout`, or
            this rank's :class:`dualkv.parallel.ShardedLayout` (sequence parallel: ``query`` is
            then the rank's shard); ``dualkv_deterministic``; others are ignored.

    Returns:
        ``(out [1, T, Hq, D], None)``.
    """
    layout = kwargs.get(LAYOUT_KWARG)
    deterministic = bool(kwargs.get(DETERMINISTIC_KWARG, False))
    if layout is None and _LAYOUT_STACK:
        layout, det = _LAYOUT_STACK[-1]
        deterministic = deterministic or det
    if layout is None:
        raise RuntimeError(
            'attn_implementation="dualkv" needs the packed batch\'s dualkv.Layout: call the model '
            "with dualkv_layout=layout (e.g. model(**packed.model_inputs())) or inside "
            "dualkv.integrations.transformers.use_layout(layout, model)"
        )
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(
            "dualkv attention runs on one packed stream: query must be [1, Hq, T, D], got "
            f"{tuple(query.shape)} (pack the batch with dualkv.pack)"
        )
    if query.shape[2] != layout.total_tokens or key.shape[2] != layout.total_tokens:
        raise ValueError(
            f"the layout has {layout.total_tokens} tokens but the attention got query length "
            f"{query.shape[2]} and key length {key.shape[2]} (a KV cache is not supported)"
        )
    if isinstance(attention_mask, LocalMask):
        # the batch's sliding-window / chunked mask: when it is shorter than the packed stream
        # (the global one under sequence parallelism: a rank's mask sees only its shard's
        # length), the layer must apply that window itself
        stream = layout.global_tokens if isinstance(layout, ShardedLayout) else layout.total_tokens
        if attention_mask.size < stream and (
            not sliding_window or int(sliding_window) != attention_mask.size
        ):
            raise NotImplementedError(
                f"{type(module).__name__}'s mask limits attention to {attention_mask.size} "
                f"tokens (a sliding window or chunked attention), but its attention call passes "
                f"sliding_window={sliding_window}: a window applied through the mask only (e.g. "
                "Qwen2-MoE's use_sliding_window, PhiMoE) or chunked attention (Llama 4) is not "
                "supported yet by the dualkv attention"
            )
        attention_mask = None
    if attention_mask is not None:
        raise ValueError(
            "dualkv attention takes its mask from the layout; got an explicit attention_mask "
            f"of shape {tuple(attention_mask.shape)} (pass attention_mask=None)"
        )
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(
            f"{type(module).__name__} passes attention sinks (s_aux, e.g. GPT-OSS): not "
            "supported yet by the dualkv attention"
        )
    check_token_mixers(getattr(module, "config", None))
    if dropout:
        raise ValueError(f"dualkv attention does not support attention dropout (got {dropout})")
    check_positions(kwargs.get("position_ids"), layout)
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise ValueError(
            f"dualkv attention is causal; {type(module).__name__} is bidirectional (e.g. Gemma 4 "
            "with use_bidirectional_attention='all'), which a shared-prompt layout cannot pack"
        )
    # mixed precision (e.g. TRL's bf16=True): q and k may leave their norms in float32 while v
    # comes from an autocast linear; attention runs in the autocast dtype, as SDPA's does (and, as
    # SDPA's, in float64 for a float64 model: autocast never casts float64)
    query, key, value = autocast_inputs(query.device.type, query, key, value)
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    # sequence parallel (dualkv.parallel): this rank's token shard, Ulysses all-to-all attention
    attend = ulysses_attention if isinstance(layout, ShardedLayout) else attention
    out = attend(
        q, k, v, layout,
        softmax_scale=scaling,
        window=int(sliding_window) if sliding_window else None,
        softcap=float(softcap) if softcap else 0.0,
        deterministic=deterministic,
    )  # fmt: skip
    assert isinstance(out, torch.Tensor)  # no lse asked for
    return out.unsqueeze(0), None


@functools.cache
def _refuse_layout(name: str, function: Any) -> Any:
    """``function`` (another attention implementation), raising if a dualkv layout reaches it
    (one wrapper per implementation, made on first use)."""

    @functools.wraps(function)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get(LAYOUT_KWARG) is not None:
            raise ValueError(
                f"a dualkv layout (dualkv_layout=...) reached attn_implementation={name!r}, which "
                "would ignore it and run plain causal attention over the packed stream. Load the "
                'model with attn_implementation="dualkv" or call model.set_attn_implementation('
                '"dualkv") (a config object shared between models switches all of them)'
            )
        return function(*args, **kwargs)

    return guarded


def register() -> None:
    """Register ``"dualkv"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, dualkv_attention_forward)
    # Every other implementation (sdpa, flash, flex, a model's own eager function) ignores
    # unknown keywords: a packed batch reaching one would run plain causal attention over the
    # packed stream. The functions the interface hands out raise instead.
    get_interface = getattr(AttentionInterface, "get_interface", None)
    if get_interface is not None and not getattr(get_interface, "_dualkv_guard", False):

        @functools.wraps(get_interface)
        def guarded_get_interface(self: Any, attn_implementation: str, default: Any) -> Any:
            function = get_interface(self, attn_implementation, default)
            if attn_implementation == ATTN_IMPLEMENTATION:
                return function
            return _refuse_layout(str(attn_implementation), function)

        guarded_get_interface._dualkv_guard = True  # type: ignore[attr-defined]
        AttentionInterface.get_interface = guarded_get_interface  # type: ignore[method-assign]
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # transformers without the mask interface builds no mask for it anyway
        return
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, dualkv_mask)
