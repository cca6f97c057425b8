""":func:`check_positions`: the position ids of a packed forward must be the layout's logical
positions (RoPE on the packed index would silently shift every response)."""

from __future__ import annotations

import reprlib
import weakref

import torch

from ...layout import SEGMENT_ROOT_START, SEGMENT_START, Layout
from ...parallel import ShardedLayout


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


# (one wording for both layouts: traced, the message is a constant of the graph, which serves
# prompt/response and tree layouts alike)
_LOGICAL = (
    "the layout's logical positions (prompt 0..P-1, each response P..P+R-1; in a tree, each "
    "segment continuing from its parent's end)"
)
_POSITIONS_MSG = (
    f"position_ids are not {_LOGICAL}: the model was probably called without position_ids, so "
    "RoPE numbered the packed tokens 0..T-1. Pass position_ids=packed.position_ids "
    "(model(**packed.model_inputs()) does)"
)
_LAYOUT_MISMATCH_MSG = (
    f"position_ids are not {_LOGICAL}: they do not follow the layout's prompts and responses "
    "(or tree segments){where}, so the positions and the layout are probably of different "
    "batches. Pass the positions and the layout of one packed batch: "
    "position_ids=packed.position_ids, dualkv_layout=packed.layout "
    "(model(**packed.model_inputs()) does)"
)
_SHARD_POSITIONS_MSG = (
    "position_ids are not this rank's slice of the sharded batch's positions: the model was "
    "probably called without position_ids, so each rank numbered its shard 0..S-1. Pass "
    "position_ids=batch.position_ids (batch.model_inputs() does)"
)


def check_positions(position_ids: torch.Tensor | None, layout: Layout | ShardedLayout) -> None:
    """Refuse position ids that are not the layout's logical positions.

    A packed stream needs RoPE on the logical positions (prompt ``0..P-1``, each response
    ``P..P+R-1``; in a tree layout each segment continues from its parent's end); a model called
    without ``position_ids`` numbers the packed tokens ``0..T-1`` instead, which would silently
    shift every response. Positions that differ from the layout's by one constant per tree (the
    tokens that attend to each other: a group, or a response of a group without a prompt; a
    root segment and its descendants) are accepted (rows' own positions taken over by
    :func:`dualkv.pack`; RoPE is relative), except ``0..T-1`` itself. On a
    :class:`dualkv.parallel.ShardedLayout` the positions must be the rank's slice of the sharded
    batch's (:func:`dualkv.parallel.shard_batch`) exactly.

    Eager: free for the layout's own tensor (``packed.position_ids``, or a shard's
    ``batch.position_ids``); other tensors are compared once (one host synchronisation) and
    remembered until they are changed in place; the error says which rule failed (and where).
    Under torch.compile the same rules are traced into the graph as device-side asserts
    (``torch._assert_async``; no host synchronisation).
    """
    if position_ids is None:
        return
    compiling = torch.compiler.is_compiling()
    if not compiling and (
        _is_layouts_own(position_ids, layout) or _checked_before(position_ids, layout)
    ):
        return
    if isinstance(layout, ShardedLayout):
        msg = f"{_SHARD_POSITIONS_MSG} (rank {layout.rank} of {layout.world_size})"
        rules = [(_shard_positions_ok(position_ids, layout), msg)]
    else:
        numbered_ok, stretches_ok = _positions_rules(position_ids, layout)
        mismatch = _LAYOUT_MISMATCH_MSG.format(where="")
        rules = [(numbered_ok, _POSITIONS_MSG), (stretches_ok, mismatch)]
    if compiling:
        for ok, msg in rules:
            torch._assert_async(ok, msg)
        return
    if not bool(torch.stack([ok for ok, _ in rules]).all()):  # (one host synchronisation)
        msg = next(msg for ok, msg in rules if not bool(ok))
        if isinstance(layout, Layout) and msg is not _POSITIONS_MSG:
            msg = _LAYOUT_MISMATCH_MSG.format(where=_first_mismatch(position_ids, layout))
        raise ValueError(msg)
    _remember(position_ids, layout)


def _is_layouts_own(position_ids: torch.Tensor, layout: Layout | ShardedLayout) -> bool:
    """Whether ``position_ids`` is the layout's own tensor (``packed.position_ids``, or a
    shard's ``batch.position_ids``): nothing to check."""
    if isinstance(layout, ShardedLayout):
        return position_ids is layout.positions
    pos, own = position_ids.reshape(-1), layout.position_ids
    return pos.data_ptr() == own.data_ptr() and pos.numel() == own.numel() and pos.stride(0) == 1


def _positions_rules(
    position_ids: torch.Tensor, layout: Layout
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rules of :func:`check_positions` as tensor ops (traceable): bool tensors ``(not
    numbered 0..T-1, one shift per tree)``."""
    own, pos = layout.position_ids, position_ids.reshape(-1)
    if pos.numel() != own.numel():
        raise ValueError(
            f"position_ids has {pos.numel()} positions but the layout has {own.numel()} tokens; "
            "pass position_ids=packed.position_ids"
        )
    pos = pos.to(own.device, torch.int64)
    delta = pos - own
    same = (delta == delta.index_select(0, _reference_tokens(layout))).all()
    # 0..T-1 passes the per-tree rule when every group has one response, yet it is what a call
    # without position_ids gives (wrong for absolute embeddings and length-dependent RoPE)
    numbered = delta.any() & (pos == torch.arange(pos.numel(), device=pos.device)).all()
    return ~numbered, same


def _reference_tokens(layout: Layout) -> torch.Tensor:
    """For each token, the token whose shift (position id minus logical position) it must share:
    one shift per tree, since every token of a tree attends to its root and RoPE is relative. A
    segment's first token refers to its root's first token (itself for a root), any other token
    to the previous one. The segment table gives each non-empty segment's start and its root's,
    whatever the order of the segments (trees may interleave in a hand-made layout).

    (Traced, the rule's reductions all run over the T tokens: reductions over T - 1 and T tokens
    made inductor's mix-order-reduction fusion assert once they were large enough to be split,
    CUDA, torch 2.11-2.13.)"""
    own = layout.position_ids
    seg = layout.segments
    ref = (torch.arange(own.shape[0], device=own.device) - 1).clamp(min=0)
    return ref.index_copy(0, seg[:, SEGMENT_START].long(), seg[:, SEGMENT_ROOT_START].long())


def _first_mismatch(position_ids: torch.Tensor, layout: Layout) -> str:
    """Where the positions first leave the layout's shift per tree, for the error message."""
    pos = position_ids.reshape(-1).to(layout.device, torch.int64)
    own = layout.position_ids
    ref = _reference_tokens(layout)
    delta = pos - own
    i = int((delta != delta[ref]).nonzero()[0, 0])
    r = int(ref[i])
    pos_l, own_l = pos.tolist(), own.tolist()
    if layout.is_tree:
        stretch, root = "a tree", "its tree's root"
        lens = (
            f"parents={reprlib.repr(list(layout.parents))}, "
            f"lengths={reprlib.repr(list(layout.lengths))}"
        )
    else:
        stretch, root = "a group", "its group's prompt"
        lens = (
            f"prefix_lens={reprlib.repr(list(layout.prefix_lens))}, "
            f"response_lens={reprlib.repr([list(r) for r in layout.response_lens])}"
        )
    if r == i - 1:
        where = (
            f": position_ids [..., {pos_l[r]}, {pos_l[i]}, ...] where the layout has "
            f"[..., {own_l[r]}, {own_l[i]}, ...] within {stretch}"
        )
    else:  # a segment's first token, against its root's first
        where = (
            f", the first of a segment: position_ids {pos_l[i]} there and {pos_l[r]} at packed "
            f"token {r}, the first of {root}, where the layout has {own_l[i]} and {own_l[r]}"
        )
    return f" (first at packed token {i}{where}; the layout's {lens})"


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
