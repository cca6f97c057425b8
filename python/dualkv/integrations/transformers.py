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
with Qwen3, Llama, Gemma3 (whose sliding-window layers get their window in logical positions) and
Gemma 4 text models (``Gemma4ForCausalLM``, and ``Gemma4ForConditionalGeneration`` on text): one
``"dualkv"`` serves their sliding (``head_dim``) and full (``global_head_dim``) layers, with
``attention_k_eq_v``, shared-KV layers (``num_kv_shared_layers``: the model hands them the packed
K/V of an earlier layer, which is on the same packed stream), per-layer input embeddings (looked up
from the packed input ids) and the final logit softcap in the log-probs.

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
import dataclasses
import functools
import inspect
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

try:
    import transformers  # noqa: F401
except ImportError as e:  # the integration is an extra
    raise ImportError(
        "dualkv.integrations.transformers needs Hugging Face transformers: pip install "
        "'dualkv[transformers]' (or pip install transformers)"
    ) from e

from ..attention import attention
from ..layout import Layout
from ..logprobs import logprobs_from_logits, response_logprobs
from ..packing import PackedBatch
from ..parallel import ShardedLayout, ulysses_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "ATTN_IMPLEMENTATION",
    "LocalMask",
    "check_packed_model",
    "check_positions",
    "check_token_mixers",
    "checkpoint_kwargs",
    "current_layout",
    "dualkv_attention_forward",
    "dualkv_mask",
    "enable_gradient_checkpointing",
    "lm_head_softcap",
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
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # mixed precision (e.g. TRL's bf16=True): q and k may leave their norms in float32 while
        # v comes from an autocast linear; attention runs in the autocast dtype, as SDPA's does
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
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


def _version(t: torch.Tensor) -> int | None:
    """The tensor's in-place version counter (None for an inference tensor, which has none: such
    a tensor is checked on every call)."""
    try:
        return int(t._version)
    except RuntimeError:
        return None


def _checked_before(position_ids: torch.Tensor, holder: Layout | ShardedLayout) -> bool:
    """Whether ``holder`` accepted this very tensor, unchanged in place since."""
    checked, version = holder._checked_positions, _version(position_ids)
    return (
        version is not None
        and checked is not None
        and checked[1] == version
        and (checked[0]() is position_ids)
    )


def _remember(position_ids: torch.Tensor, holder: Layout | ShardedLayout) -> None:
    holder._checked_positions = (weakref.ref(position_ids), _version(position_ids))


_POSITIONS_MSG = (
    "position_ids are not the layout's logical positions (prompt 0..P-1, each response "
    "P..P+R-1): the model was probably called without position_ids, so RoPE numbered the packed "
    "tokens 0..T-1. Pass position_ids=packed.position_ids (model(**packed.model_inputs()) does)"
)
_SHARD_POSITIONS_MSG = (
    "position_ids are not this rank's slice of the sharded batch's positions: the model was "
    "probably called without position_ids, so each rank numbered its shard 0..S-1. Pass "
    "position_ids=batch.position_ids (batch.model_inputs() does)"
)


def check_positions(position_ids: torch.Tensor | None, layout: Layout | ShardedLayout) -> None:
    """Refuse position ids that are not the layout's logical positions.

    A packed stream needs RoPE on the logical positions (prompt ``0..P-1``, each response
    ``P..P+R-1``); a model called without ``position_ids`` numbers the packed tokens ``0..T-1``
    instead, which would silently shift every response. Positions that differ from the layout's
    by a constant over each stretch that attention never crosses (a group; a response of a group
    without a prompt) are accepted (rows' own positions taken over by :func:`dualkv.pack`; RoPE
    is relative), except ``0..T-1`` itself. On a :class:`dualkv.parallel.ShardedLayout` the
    positions must be the rank's slice of the sharded batch's
    (:func:`dualkv.parallel.shard_batch`) exactly.

    Eager: free for the layout's own tensor (``packed.position_ids``, or a shard's
    ``batch.position_ids``); other tensors are compared once (one host synchronisation) and
    remembered until they are changed in place. Under torch.compile the same rule is traced into
    the graph as a device-side assert (``torch._assert_async``; no host synchronisation).
    """
    if position_ids is None:
        return
    if isinstance(layout, ShardedLayout):
        rule = functools.partial(_shard_positions_ok, position_ids, layout)
        msg = f"{_SHARD_POSITIONS_MSG} (rank {layout.rank} of {layout.world_size})"
    else:
        rule = functools.partial(_positions_ok, position_ids, layout)
        msg = _POSITIONS_MSG
    if torch.compiler.is_compiling():
        torch._assert_async(rule(), msg)
        return
    if _is_layouts_own(position_ids, layout) or _checked_before(position_ids, layout):
        return
    if not bool(rule()):
        raise ValueError(msg)
    _remember(position_ids, layout)


def _is_layouts_own(position_ids: torch.Tensor, layout: Layout | ShardedLayout) -> bool:
    """Whether ``position_ids`` is the layout's own tensor (``packed.position_ids``, or a
    shard's ``batch.position_ids``): nothing to check."""
    if isinstance(layout, ShardedLayout):
        return position_ids is layout.positions
    pos, own = position_ids.reshape(-1), layout.position_ids
    return pos.data_ptr() == own.data_ptr() and pos.numel() == own.numel() and pos.stride(0) == 1


def _positions_ok(position_ids: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The rule of :func:`check_positions` as tensor ops (a bool tensor; traceable)."""
    own, pos = layout.position_ids, position_ids.reshape(-1)
    if pos.numel() != own.numel():
        raise ValueError(
            f"position_ids has {pos.numel()} positions but the layout has {own.numel()} tokens; "
            "pass position_ids=packed.position_ids"
        )
    pos = pos.to(own.device, torch.int64)
    delta = pos - own
    # a logical position 0 starts a stretch attention never crosses: a group's prompt, or a
    # response of a group without a prompt
    same = ((delta[1:] == delta[:-1]) | (own[1:] == 0)).all()
    # 0..T-1 passes the per-stretch rule when every group has one response, yet it is what a call
    # without position_ids gives (wrong for absolute embeddings and length-dependent RoPE)
    numbered = delta.any() & (pos == torch.arange(pos.numel(), device=pos.device)).all()
    return same & ~numbered


def _shard_positions_ok(position_ids: torch.Tensor, layout: ShardedLayout) -> torch.Tensor:
    """A shard's positions, compared exactly (a bool tensor; traceable): a per-group shift is
    only visible within one rank's tokens, so shifts that differ between ranks (each rank
    numbering its shard 0..S-1) would pass the per-group rule."""
    want = layout.positions
    if want is None:  # (a ShardedLayout made by hand: the layout's logical positions)
        want = layout.shard(layout.layout.position_ids, pad_value=0)
    want, pos = want.reshape(-1), position_ids.reshape(-1)
    if pos.numel() != want.numel():
        raise ValueError(
            f"position_ids has {pos.numel()} positions but this rank's shard has "
            f"{want.numel()} tokens; pass position_ids=batch.position_ids"
        )
    return (pos.to(want.device, torch.int64) == want).all()


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
        for name, m in _decoder(model).named_modules():  # (not a vision / audio tower)
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
    check_packed_model(model, kwargs, packed)
    if packed.total_tokens == 0:  # (an empty batch: transformers' forward cannot run on 0 tokens)
        embed = cast(torch.Tensor, model.get_input_embeddings().weight)
        return embed.new_zeros(1, 0, _text_config(model).hidden_size)
    out = _decoder(model)(**packed.model_inputs(), **kwargs)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


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
    config = _text_config(model)
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
    text_decoder = _decoder(model)
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
    text_config = _text_config(model)
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
    ropes = _length_dependent_ropes(_text_config(model))
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
    text_config = _text_config(model)
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


def _lm_head(model: PreTrainedModel) -> tuple[torch.Tensor, torch.Tensor | None, float | None]:
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (LM head)")
    return head.weight, getattr(head, "bias", None), lm_head_softcap(model)


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
