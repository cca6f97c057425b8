"""HF transformers backend: ``attn_implementation="dualkv"``.

Importing this module registers ``"dualkv"`` in transformers' attention interface
(``AttentionInterface`` / ``ALL_ATTENTION_FUNCTIONS``) and its mask interface
(``AttentionMaskInterface``: the mask is the layout itself, so no ``[T, T]`` mask is ever built).
A model loaded or switched to it runs on a packed batch ``[1, T]`` (from :func:`dualkv.pack`) with
the batch's :class:`dualkv.Layout` given either

* as a keyword of the model's forward, ``model(**packed.model_inputs())`` (it carries
  ``dualkv_layout=layout``): robust under gradient checkpointing, since transformers replays a
  checkpointed layer with the same keywords; or
* through :func:`use_layout`: ``with use_layout(layout, model): model(input_ids, position_ids=...)``
  (with ``model`` the layout is injected as that keyword too; without it, the layout is read from
  a process-wide stack, and a checkpointed backward must then run inside the ``with`` block).

Every decoder of transformers that dispatches through ``ALL_ATTENTION_FUNCTIONS`` works; tested
with Qwen3, Llama and Gemma3 (whose sliding-window layers get their window in logical positions).

Typical step::

    import dualkv
    from dualkv.integrations.transformers import packed_response_logprobs

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="dualkv")
    packed = dualkv.pack(input_ids, attention_mask, prompt_width, group_ids)
    logp = packed_response_logprobs(model, packed, temperature=1.0)  # [B, R_max]
    loss, stats = dualkv.dapo_loss(logp, old_logp, advantages, packed.response_mask)
    loss.backward()
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..attention import attention
from ..layout import Layout
from ..logprobs import logprobs_from_logits, response_logprobs
from ..packing import PackedBatch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "ATTN_IMPLEMENTATION",
    "checkpoint_kwargs",
    "current_layout",
    "dualkv_attention_forward",
    "dualkv_mask",
    "enable_gradient_checkpointing",
    "packed_hidden_states",
    "packed_response_logprobs",
    "register",
    "rows_response_logprobs",
    "use_layout",
]

ATTN_IMPLEMENTATION = "dualkv"
LAYOUT_KWARG = "dualkv_layout"
DETERMINISTIC_KWARG = "dualkv_deterministic"

# Process-wide (not thread-local: the autograd engine may replay a checkpointed layer on its
# device thread) stack of (layout, deterministic) set by use_layout().
_LAYOUT_STACK: list[tuple[Layout, bool]] = []


def current_layout() -> Layout | None:
    """The innermost layout set by :func:`use_layout`, or None."""
    return _LAYOUT_STACK[-1][0] if _LAYOUT_STACK else None


@contextlib.contextmanager
def use_layout(
    layout: Layout, model: PreTrainedModel | None = None, deterministic: bool = False
) -> Iterator[Layout]:
    """Make ``layout`` the layout of ``"dualkv"`` attention inside the ``with`` block.

    Args:
        layout: the packed batch's :class:`dualkv.Layout`.
        model: optional model; when given, a forward pre-hook adds ``dualkv_layout=layout`` to
            its decoder's forward keywords, so gradient-checkpointed layers replay with it even
            when the backward runs after the block.
        deterministic: bitwise-reproducible attention gradients.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a dualkv.Layout, got {type(layout).__name__}")
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
        target = _decoder(model)
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
        attention_mask: must be None (the layout is the mask).
        dropout: must be 0 (attention dropout is not supported).
        scaling: softmax scale (default ``1/sqrt(D)``).
        sliding_window: the layer's window in logical positions (``pos(q) - pos(k) < w``).
        softcap: attention logit soft-capping (Gemma 2 style), None for none.
        kwargs: ``dualkv_layout`` (else :func:`current_layout`), ``dualkv_deterministic``;
            others are ignored.

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
    if attention_mask is not None:
        raise ValueError(
            "dualkv attention takes its mask from the layout; got an explicit attention_mask "
            f"of shape {tuple(attention_mask.shape)} (pass attention_mask=None)"
        )
    if dropout:
        raise ValueError(f"dualkv attention does not support attention dropout (got {dropout})")
    if not getattr(module, "is_causal", True):
        raise ValueError("dualkv attention is causal; this module is not (bidirectional attention)")
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # mixed precision (e.g. TRL's bf16=True): q and k may leave their norms in float32 while
        # v comes from an autocast linear; attention runs in the autocast dtype, as SDPA's does
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    out = attention(
        q, k, v, layout,
        softmax_scale=scaling,
        window=int(sliding_window) if sliding_window else None,
        softcap=float(softcap) if softcap else 0.0,
        deterministic=deterministic,
    )  # fmt: skip
    assert isinstance(out, torch.Tensor)  # no lse asked for
    return out.unsqueeze(0), None


def dualkv_mask(*args: Any, **kwargs: Any) -> None:
    """Mask function of ``"dualkv"`` (transformers' mask interface): no mask, the layout is it."""
    return None


def register() -> None:
    """Register ``"dualkv"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, dualkv_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # transformers without the mask interface builds no mask for it anyway
        return
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, dualkv_mask)


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


def _decoder(model: PreTrainedModel) -> torch.nn.Module:
    """The decoder stack of a causal LM (what returns the final hidden states)."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    if decoder is None or decoder is model:
        decoder = getattr(model, "model", None)
    if not isinstance(decoder, torch.nn.Module):
        decoder = getattr(model, "base_model", model)
    assert isinstance(decoder, torch.nn.Module)
    return decoder


def _text_config(model: PreTrainedModel) -> Any:
    config = model.config
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def packed_hidden_states(
    model: PreTrainedModel, packed: PackedBatch, **kwargs: Any
) -> torch.Tensor:
    """Final hidden states ``[1, T, H]`` of a causal LM's decoder on a packed batch.

    The model must use ``attn_implementation="dualkv"``; ``kwargs`` go to the decoder's forward.
    """
    impl = getattr(_text_config(model), "_attn_implementation", None)
    if impl != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"the model uses attn_implementation={impl!r}; load it with "
            'attn_implementation="dualkv"'
            ' or call model.set_attn_implementation("dualkv")'
        )
    out = _decoder(model)(**packed.model_inputs(), **kwargs)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _lm_head(model: PreTrainedModel) -> tuple[torch.Tensor, torch.Tensor | None, float | None]:
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (LM head)")
    softcap = getattr(_text_config(model), "final_logit_softcapping", None)
    return head.weight, getattr(head, "bias", None), softcap


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
    weight, bias, softcap = _lm_head(model)
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


register()
