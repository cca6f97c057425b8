"""Ulysses sequence parallelism for packed shared-prompt streams (``dualkv.parallel``).

A packed micro-batch of T tokens is sharded by tokens over the ``sp`` ranks of a
``torch.distributed`` process group: rank ``r`` holds tokens ``[r * S, (r + 1) * S)`` with
``S = ceil(T / sp)``; the stream is padded to ``sp * S`` tokens, so the last rank(s) carry up to
``sp - 1`` pad tokens. Every token-wise layer (embeddings, norms, projections, MLP, RoPE with each
rank's slice of the global position ids) runs on the local shard. Attention
(:func:`ulysses_attention`) is the only place where the ranks talk:

1. all-to-all ``q [S, Hq, D] -> [sp*S, Hq/sp, D]`` (and k, v): every rank now holds the *whole*
   packed stream for ``Hq/sp`` of the heads;
2. the pad tokens are sliced off (they are the stream's last tokens) and :func:`dualkv.attention`
   runs unchanged on the global :class:`dualkv.Layout` for those heads;
3. the output (and lse) is zero-padded back and all-to-all'ed to ``[S, Hq, D]`` (``[Hq, S]``).

Nothing here depends on the layout's shape: a prefix-tree layout (:meth:`dualkv.Layout.tree`,
``dualkv.pack(..., tree=True)``) is sharded the same way, a shard boundary anywhere (inside a
segment, or at a branch point whose last position predicts each child's first token on the next
rank).

The backward is the mirror image (autograd through the all-to-alls: gradients take the reverse
all-to-all, nothing is gathered). The pad tokens never reach the kernel: their attention output
and lse are 0 and their q/k/v gradients exactly 0, whatever they hold (NaN included).

GQA/MQA with ``Hkv`` not a multiple of ``sp``: each KV head is replicated
``m = sp / gcd(Hkv, sp)`` times before the all-to-all (``Hkv * m = lcm(Hkv, sp)`` heads, which
divides ``Hq``), so that every rank receives the KV heads its query heads
use; the replicas' gradients are summed by autograd (``repeat_interleave``'s backward). ``Hq`` must
be a multiple of ``sp``. With ``Hkv % sp == 0`` nothing is replicated.

Model level: :func:`shard_batch` turns the (replicated) global :class:`dualkv.PackedBatch` into this
rank's :class:`ShardedBatch`; ``model(**sharded.model_inputs())`` runs a HF model with
``attn_implementation="dualkv"`` on the shard (the :class:`ShardedLayout` rides in the
``dualkv_layout`` keyword, or in :func:`dualkv.integrations.transformers.use_layout`, and the
attention dispatches to :func:`ulysses_attention`). :func:`response_logprobs` scores, on each rank,
the response tokens whose *predicting* position is local (labels come from the global batch, so a
label on the next rank or the prompt's last position predicting every response's first token need
no communication), then sums the ranks' disjoint parts: every rank gets the full ``[B, R_max]``
log-probs, bitwise what its own rank computed, and any loss on them (token-mean over the global
token count included) is the global loss, the same on every rank. The backward of that sum is the
identity, so each rank's backward gives *its tokens' share* of every parameter gradient; the sum
over the group is the gradient of the global loss (:func:`all_reduce_gradients`, or data-parallel
reduction over a mesh that includes the SP ranks: if that reduction *averages* over the SP ranks,
as FSDP over a flat ``dp * sp`` mesh does, pass ``grad_scale=sp``, as veRL's Ulysses gather does).

For trainers: :func:`dualkv.integrations.transformers.sequence_parallel_logprobs` is the one call
per micro-batch of a HF model (shard, forward, log-probs).

Cost per decoder layer and rank (T packed tokens, element size b bytes, ``Hkv' = Hkv * m``):

* memory: every activation is 1/sp of the single-GPU one (token-wise tensors hold S = T/sp tokens;
  attention holds the whole stream for Hq/sp and Hkv'/sp heads:
  ``T * D * b * (2 Hq + 2 Hkv') / sp`` for q, k, v, out, plus ``4 T Hq / sp`` bytes of lse); only
  the layout metadata and the ``[B, R_max]`` log-probs are replicated;
* communication (bytes sent by each rank): forward ``(sp-1)/sp^2 * T * D * b * (2 Hq + 2 Hkv')``
  (q, k, v in, out back), the backward as much again (dout in; dq, dk, dv back); a checkpointed
  layer's recompute repeats the forward all-to-alls of q, k, v (and out).

Padding adds at most ``sp - 1`` tokens. With a group of size 1 every collective is skipped and the
path reduces to the single-GPU one. ``torch.compile`` (dynamo) traces :func:`ulysses_attention`
without graph breaks (checked with the eager and aot_eager backends on gloo).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .attention import attention
from .layout import Layout
from .logprobs import score_tokens
from .packing import PackedBatch

__all__ = [
    "ShardedBatch",
    "ShardedLayout",
    "all_reduce_gradients",
    "all_to_all",
    "kv_replication",
    "response_logprobs",
    "shard_batch",
    "ulysses_attention",
]


def __getattr__(name: str) -> Any:
    # moved to the HF integration (it runs a transformers model), which imports this module
    if name == "sequence_parallel_logprobs":
        from .integrations.transformers import sequence_parallel_logprobs

        warnings.warn(
            "dualkv.parallel.sequence_parallel_logprobs moved to "
            "dualkv.integrations.transformers.sequence_parallel_logprobs",
            DeprecationWarning,
            stacklevel=2,
        )
        return sequence_parallel_logprobs
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _group_size(group: Any) -> tuple[int, int]:
    """(world size, rank) of ``group`` (the default group for None)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "dualkv sequence parallelism needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group)"
        )
    return dist.get_world_size(group), dist.get_rank(group)


def weighted_sum(x: torch.Tensor) -> torch.Tensor:
    """An int64 fingerprint of ``x``'s values in order (``sum_i (i + 1) * x_i``, wrapping)."""
    v = x.detach().reshape(-1).to(torch.int64)
    return (v * torch.arange(1, v.numel() + 1, device=v.device)).sum()


def same_on_ranks(values: torch.Tensor, group: Any = None) -> bool:
    """Whether every rank of ``group`` holds the same int64 ``values`` (a small fingerprint, on
    a device the group's backend takes). One all-reduce and one host synchronisation; every rank
    gets the same answer, so all raise together."""
    both = torch.cat([values, -values]).to(torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    n = values.numel()
    return bool(torch.equal(both[:n], -both[n:]))


# --- collectives with autograd ----------------------------------------------------------------
def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any) -> torch.Tensor:
    world = dist.get_world_size(group)
    if world == 1:
        return x
    if x.shape[scatter_dim] % world:
        raise ValueError(
            f"all_to_all: dim {scatter_dim} of a {tuple(x.shape)} tensor is not a multiple of "
            f"the group size {world}"
        )
    # [world, ...]: chunk j (sent to rank j) is the j-th slice of scatter_dim (a view when
    # scatter_dim is 0, else one copy)
    send = x.unflatten(scatter_dim, (world, -1)).movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[i] came from rank i: concatenate along gather_dim in rank order (a view for dim 0)
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any
    ) -> torch.Tensor:
        ctx.dims = (scatter_dim, gather_dim)
        ctx.group = group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Any = None
) -> torch.Tensor:
    """Differentiable all-to-all: split ``x`` into ``sp`` chunks along ``scatter_dim``, send chunk
    ``j`` to rank ``j``, concatenate the received chunks along ``gather_dim`` in rank order.

    The backward is the reverse all-to-all of the gradient. Identity for a group of size 1.
    """
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


class _SumReplicated(torch.autograd.Function):
    """Forward: sum over the group. Backward: the identity (times ``scale``), because every rank
    goes on with the same sum and computes the same loss from it: each rank's part then receives
    that loss's gradient once (Megatron's "reduce from the model-parallel region")."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, group: Any, scale: float
    ) -> torch.Tensor:
        ctx.scale = scale
        if dist.get_world_size(group) == 1:
            return x
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return (grad * ctx.scale if ctx.scale != 1.0 else grad), None, None


class _GatherTokens(torch.autograd.Function):
    """Forward: all-gather the shards of dim 0. Backward: this rank's slice of the gradient (times
    ``scale``): every rank goes on with the same gathered tensor."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, group: Any, rank: int, scale: float
    ) -> torch.Tensor:
        ctx.rank, ctx.rows, ctx.scale = rank, x.shape[0], scale
        world = dist.get_world_size(group)
        if world == 1:
            return x
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        g = grad.narrow(0, ctx.rank * ctx.rows, ctx.rows)
        return (g * ctx.scale if ctx.scale != 1.0 else g), None, None, None


# --- the sharded layout -----------------------------------------------------------------------
class ShardedLayout:
    """This rank's shard of a packed stream sharded by tokens over ``group``.

    Args:
        layout: the global :class:`dualkv.Layout` (the same on every rank of the group), on this
            rank's device.
        group: the sequence-parallel process group (None: the default group).

    Rank ``r`` holds global tokens ``[start, start + shard_tokens)`` of the stream padded to
    ``padded_tokens = sp * shard_tokens``; ``real_tokens`` of them are real (the others are
    padding at the end of the stream). ``total_tokens`` is ``shard_tokens``, the token count the
    model sees on this rank, so the object passes wherever the HF backend takes a layout.
    """

    # the last position-id tensor dualkv.integrations.transformers.check_positions accepted
    _checked_positions: Any = None
    # this rank's slice of the batch's position ids (set by shard_batch): the positions the model
    # must see here exactly (a per-group shift that differs between ranks would go unnoticed)
    positions: torch.Tensor | None = None

    def __init__(self, layout: Layout, group: Any = None) -> None:
        if not isinstance(layout, Layout):
            raise TypeError(f"layout must be a dualkv.Layout, got {type(layout).__name__}")
        self.layout = layout
        self.group = group
        self.world_size, self.rank = _group_size(group)
        total = layout.total_tokens
        self.global_tokens = total
        self.shard_tokens = -(-total // self.world_size)
        self.padded_tokens = self.shard_tokens * self.world_size
        self.start = self.rank * self.shard_tokens
        self.real_tokens = max(0, min(total - self.start, self.shard_tokens))

    @property
    def total_tokens(self) -> int:
        """Tokens of this rank's shard, padding included (``shard_tokens``)."""
        return self.shard_tokens

    @property
    def device(self) -> torch.device:
        """The device of the layout's metadata."""
        return self.layout.device

    def shard(self, x: torch.Tensor, dim: int = 0, pad_value: float = 0) -> torch.Tensor:
        """This rank's slice ``[start, start + shard_tokens)`` of a global per-token tensor (size
        ``global_tokens`` along ``dim``), padded with ``pad_value`` past the stream's end.
        Differentiable (a slice and a pad)."""
        dim = dim % x.dim()
        if x.shape[dim] != self.global_tokens:
            raise ValueError(
                f"shard: dim {dim} of x must have the layout's {self.global_tokens} tokens, got "
                f"shape {tuple(x.shape)}"
            )
        start = min(self.start, self.global_tokens)
        part = x.narrow(dim, start, self.real_tokens)
        missing = self.shard_tokens - self.real_tokens
        if missing == 0:
            return part
        pad = [0, 0] * (x.dim() - 1 - dim) + [0, missing]
        return torch.nn.functional.pad(part, pad, value=pad_value)

    def gather(self, x: torch.Tensor, dim: int = 0, grad_scale: float = 1.0) -> torch.Tensor:
        """The global tensor (``global_tokens`` along ``dim``, padding dropped) from every rank's
        shard. Differentiable: every rank must go on with the result alike (the backward hands
        each rank its own slice of the gradient, times ``grad_scale``)."""
        dim = dim % x.dim()
        if x.shape[dim] != self.shard_tokens:
            raise ValueError(
                f"gather: dim {dim} of x must have the shard's {self.shard_tokens} tokens, got "
                f"shape {tuple(x.shape)}"
            )
        full = _GatherTokens.apply(x.movedim(dim, 0), self.group, self.rank, float(grad_scale))
        return full[: self.global_tokens].movedim(0, dim)

    def __repr__(self) -> str:
        return (
            f"dualkv.parallel.ShardedLayout(rank={self.rank}/{self.world_size}, "
            f"tokens=[{self.start}, {self.start + self.shard_tokens}) of {self.global_tokens} "
            f"(+{self.padded_tokens - self.global_tokens} pad), layout={self.layout!r})"
        )


def kv_replication(num_q_heads: int, num_kv_heads: int, world_size: int) -> int:
    """How many times each KV head is replicated for an all-to-all over ``world_size`` ranks
    (``world_size / gcd(Hkv, world_size)``; 1 when ``Hkv % world_size == 0``).

    Raises ``ValueError`` when ``Hq`` is not a multiple of the group size (or of ``Hkv``).
    """
    if num_q_heads % world_size:
        raise ValueError(
            f"Ulysses sequence parallelism splits the heads over the group: Hq={num_q_heads} must "
            f"be a multiple of the group size {world_size}"
        )
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} must be a multiple of Hkv={num_kv_heads}")
    # Hkv * m = lcm(Hkv, sp) divides Hq, which is a multiple of both: every rank's Hq/sp query
    # heads then use its Hkv*m/sp replicated KV heads in GQA order
    m = world_size // math.gcd(num_kv_heads, world_size)
    return m


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: ShardedLayout,
    softmax_scale: float | None = None,
    window: int | None = None,
    softcap: float | None = 0.0,
    return_lse: bool = False,
    deterministic: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`dualkv.attention` on a token-sharded packed stream (Ulysses), differentiable.

    Args:
        q: ``[S, Hq, D]`` this rank's queries (``S = layout.shard_tokens``, padding included).
        k, v: ``[S, Hkv, D]``.
        layout: this rank's :class:`ShardedLayout`.
        softmax_scale, window, softcap, return_lse, deterministic: as :func:`dualkv.attention`.

    Returns:
        ``out`` ``[S, Hq, D]`` (and ``lse`` ``[Hq, S]``): this rank's rows of the global
        attention; 0 on padding rows. Every rank of the group must call it (a collective).
    """
    if not isinstance(layout, ShardedLayout):
        raise TypeError(
            f"layout must be a dualkv.parallel.ShardedLayout, got {type(layout).__name__}"
        )
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [S, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    s = layout.shard_tokens
    if q.shape[0] != s or k.shape[0] != s or v.shape[0] != s:
        raise ValueError(
            f"this rank's shard has {s} tokens, but q, k, v have {q.shape[0]}, {k.shape[0]}, "
            f"{v.shape[0]}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    world, group = layout.world_size, layout.group
    if world == 1 or layout.global_tokens == 0:  # no collective, no padding: the local call
        return attention(q, k, v, layout.layout, softmax_scale, window, softcap, return_lse,
                         deterministic)  # fmt: skip
    m = kv_replication(q.shape[1], k.shape[1], world)
    if m > 1:
        k = k.repeat_interleave(m, dim=1)
        v = v.repeat_interleave(m, dim=1)
    total = layout.global_tokens
    # [S, H, D] -> [sp*S, H/sp, D], then the stream's real tokens (a view: padding is at the end)
    qg, kg, vg = (all_to_all(x, 1, 0, group)[:total] for x in (q, k, v))
    res = attention(qg, kg, vg, layout.layout, softmax_scale, window, softcap, True, deterministic)
    out, lse = res
    missing = layout.padded_tokens - total
    if missing:
        out = torch.nn.functional.pad(out, (0, 0, 0, 0, 0, missing))
    out = all_to_all(out, 0, 1, group)  # [sp*S, Hq/sp, D] -> [S, Hq, D]
    if not return_lse:
        return out
    if missing:
        lse = torch.nn.functional.pad(lse, (0, missing))
    return out, all_to_all(lse, 1, 0, group)  # [Hq/sp, sp*S] -> [Hq, S]


# --- the sharded batch and its log-probs ------------------------------------------------------
@dataclass
class ShardedBatch:
    """This rank's shard of a :class:`dualkv.PackedBatch` (see :func:`shard_batch`).

    Attributes:
        packed: the global batch (the same on every rank).
        layout: this rank's :class:`ShardedLayout`.
        input_ids: ``[1, S]`` this rank's token ids (pad tokens: ``pad_id``).
        position_ids: ``[1, S]`` this rank's slice of the global position ids (pad: 0).
        token_rows: ``[M_r]`` flat row index ``b * R_max + j`` of each response token whose
            predicting position is on this rank.
        token_sources: ``[M_r]`` that position, as a local index into the shard.
        token_labels: ``[M_r]`` the token ids to score (from the global batch, wherever the
            token itself lives).
    """

    packed: PackedBatch
    layout: ShardedLayout
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    token_rows: torch.Tensor
    token_sources: torch.Tensor
    token_labels: torch.Tensor

    @property
    def total_tokens(self) -> int:
        """Tokens of this rank's shard (padding included)."""
        return self.layout.shard_tokens

    @property
    def response_mask(self) -> torch.Tensor:
        """``[B, R_max]`` the global batch's response mask."""
        return self.packed.response_mask

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for a HF model forward with ``attn_implementation="dualkv"``."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "dualkv_layout": self.layout,
            "use_cache": False,
        }


def _check_same_batch(packed: PackedBatch, group: Any) -> None:
    """Refuse ranks that pass different batches: each would run attention on its heads with its
    own layout, a silent wrong answer. The layout is compared as its segments' parents and
    lengths (a prompt/response layout's depth-two forest, or a tree's). The rows' response width
    is part of it: the log-probs' all-reduce sums ``[B, R_max]`` tensors, which must have one
    shape on every rank."""
    layout = packed.layout
    shape = hash((layout.parents, layout.lengths, packed.num_rows, packed.max_response_len))
    fingerprint = torch.stack([
        torch.tensor(shape, dtype=torch.int64, device=packed.input_ids.device),
        weighted_sum(packed.input_ids), weighted_sum(packed.position_ids),
    ])  # fmt: skip
    if not same_on_ranks(fingerprint, group):
        raise ValueError(
            "shard_batch: the ranks of the sequence-parallel group passed different packed "
            "batches (layouts, token ids, positions or the rows' response width); every rank "
            "must pass the same global batch"
        )


def shard_batch(packed: PackedBatch, group: Any = None, pad_id: int = 0) -> ShardedBatch:
    """This rank's :class:`ShardedBatch` of a packed batch sharded by tokens over ``group``.

    Every rank of the group passes the same global ``packed`` batch (token ids are small; the
    activations are what is sharded); a difference is refused (one small all-reduce). Two host
    synchronisations per batch (that check, and selecting this rank's scored tokens), none for a
    group of size 1.
    """
    sl = ShardedLayout(packed.layout, group)
    if sl.world_size > 1:
        _check_same_batch(packed, group)
    ids = sl.shard(packed.input_ids, dim=1, pad_value=pad_id)
    pos = sl.shard(packed.position_ids, dim=1, pad_value=0)
    sl.positions = pos
    rows, sources, labels = packed.token_rows, packed.token_sources, packed.token_labels
    if sl.world_size > 1:
        local = (sources >= sl.start) & (sources < sl.start + sl.real_tokens)
        keep = local.nonzero().flatten()
        rows, labels = rows.index_select(0, keep), labels.index_select(0, keep)
        sources = sources.index_select(0, keep) - sl.start
    return ShardedBatch(packed, sl, ids, pos, rows, sources, labels)


def response_logprobs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    batch: ShardedBatch,
    temperature: float = 1.0,
    return_entropy: bool = False,
    lm_head_bias: torch.Tensor | None = None,
    logit_softcap: float | None = None,
    chunk_size: int | None = None,
    grad_scale: float = 1.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`dualkv.response_logprobs` on a token-sharded stream: the full ``[B, R_max]``
    log-probs (and entropy) of the global batch on every rank.

    Args:
        hidden_states: ``[1, S, H]`` or ``[S, H]`` this rank's final hidden states.
        batch: this rank's :class:`ShardedBatch`.
        grad_scale: the backward hands each rank's tokens ``grad_scale`` times the gradient of
            the (replicated) loss: 1 when the parameter gradients are then summed over the group
            (:func:`all_reduce_gradients`), ``sp`` when a data-parallel reduction averages over
            the SP ranks.
        others: as :func:`dualkv.response_logprobs`.

    Each rank scores the tokens predicted from its own positions with the chunked log-prob ops;
    one all-reduce of ``B * R_max`` values (two with entropy, in one call) sums the disjoint parts.
    A collective: every rank of the group must call it.
    """
    logp, ent = score_tokens(
        hidden_states, lm_head_weight, lm_head_bias, batch.token_sources, batch.token_labels,
        batch.total_tokens, temperature, logit_softcap, chunk_size, return_entropy,
    )  # fmt: skip
    shape = batch.packed.response_mask.shape
    width = shape[0] * shape[1]
    parts = [logp, ent] if return_entropy else [logp]
    flat = [p.new_zeros(width).index_copy(0, batch.token_rows, p) for p in parts]
    both = torch.stack(flat) if return_entropy else flat[0]
    summed = _SumReplicated.apply(both, batch.layout.group, float(grad_scale))
    if return_entropy:
        return summed[0].view(shape), summed[1].view(shape)
    return summed.view(shape)


def all_reduce_gradients(parameters: Iterable[torch.nn.Parameter], group: Any = None) -> None:
    """Sum every parameter's ``.grad`` over the SP group (in place): afterwards each rank holds
    the gradient of the global loss. Parameters without a gradient are skipped (the same on every
    rank: every rank runs the same model). No-op for a group of size 1."""
    world, _ = _group_size(group)
    if world == 1:
        return
    for p in parameters:
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
