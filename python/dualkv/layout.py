"""The layout of a micro-batch (dualkv.Layout): shared prompts, or prefix trees."""

from __future__ import annotations

import functools
import numbers
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch

from ._ops import ops

# Lengths are int32 in the layout tables: a larger one is refused here, naming the argument (the
# C++ core checks signs and totals).
_MAX_LEN = 2**31 - 1


def _ints(value: Any, name: str) -> list[int]:
    """``value`` (a sequence, or a 1-D tensor or numpy array) as a list of Python ints; a bool, a
    float or a nested list raises TypeError naming the entry."""
    if isinstance(value, torch.Tensor) or (
        hasattr(value, "tolist") and type(value).__module__ == "numpy"
    ):
        if value.ndim != 1:
            raise TypeError(f"{name} must be one-dimensional, got shape {tuple(value.shape)}")
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of ints, got {type(value).__name__}")
    out = []
    for i, x in enumerate(value):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"{name}[{i}] must be an int, got {type(x).__name__} ({x!r})")
        out.append(int(x))
    return out


# Columns of the segment table (Layout.segments, int32 [non-empty segments, 11]): include/
# dualkv/layout.h's struct Segment.
SEGMENT_START = 0  # packed index of the segment's first token
SEGMENT_ROOT_START = 3  # packed index of the first token of its tree's root segment


def _int_list(value: Any, name: str) -> list[int]:
    """Lengths as the C++ core takes them (it checks signs and totals)."""
    out = _ints(value, name)
    for i, x in enumerate(out):
        if x > _MAX_LEN:  # (negative lengths are reported by the C++ core ...)
            raise ValueError(f"{name}[{i}] = {x} exceeds the int32 range of the layout")
        if x < -_MAX_LEN:  # (... where they fit its int64 arguments)
            raise ValueError(f"{name}[{i}] = {x} is negative")
    return out


def _parent_list(value: Any, name: str) -> list[int]:
    """Parent indices; the C++ core checks that each is -1 or an earlier segment (one that does
    not fit its int64 arguments is refused here with the same rule)."""
    out = _ints(value, name)
    for i, x in enumerate(out):
        if not -1 <= x <= _MAX_LEN:
            raise ValueError(
                f"{name}[{i}] = {x}: a segment's parent must come before it in the list "
                f"({name}[i] < i) or be -1 for a root"
            )
    return out


def check_window(window: Any) -> int | None:
    """A sliding window as the op takes it: None, or an int number of tokens >= 1 (a bool is
    refused). A window of 2^31 - 1 tokens or more sees every earlier key (logical positions are
    int32), so it is no window: exactly None. (Passed on, one beyond int64 failed in the op's
    argument parser with "Expected Optional[int] but found int", and one in [2^31, 2^63) was
    refused as not "a positive number of tokens".)"""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, numbers.Integral):
        raise TypeError(f"window must be None or an int number of tokens, got {window!r}")
    window = int(window)
    if window < 1:
        raise ValueError(f"window must be None or a positive number of tokens, got {window}")
    return None if window >= _MAX_LEN else window


def mark_per_batch(t: torch.Tensor, *dims: int, unbacked: bool = False) -> torch.Tensor:
    """Tells torch.compile that sizes ``dims`` of ``t`` change from batch to batch, so the first
    compilation is already dynamic in them (instead of a static graph, then a recompilation).

    A hint only (sizes 0 and 1 may still be specialised; ``unbacked=True`` marks the sizes
    unbacked as well, so those are not), and only once torch.compile is in use (dynamo
    imported): eager code pays nothing.
    """
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        for d in dims:
            dynamo.maybe_mark_dynamic(t, d)
            if unbacked:
                dynamo.decorators.mark_unbacked(t, d)
    return t


_F = TypeVar("_F", bound=Callable[..., Any])


def eager_only(fn: _F) -> _F:
    """Runs ``fn`` eagerly, as a graph break under torch.compile (a clear error with
    fullgraph=True): building a layout (or moving it) reads its lengths on the host and makes
    tables whose sizes depend on them; traced, dualkv::layout_tables (no fake implementation)
    crashed dynamo and maybe_mark_dynamic is forbidden. Like mark_per_batch, it only involves
    dynamo once torch.compile is in use (importing it costs a second)."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is None:
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(dynamo.disable(fn, reason=_EAGER_ONLY))
        return disabled[0](*args, **kwargs)

    return cast(_F, inner)


_EAGER_ONLY = (
    "dualkv.Layout is built on the host, outside the compiled graph: build it before calling the "
    "compiled function and pass it in (one dynamic graph serves every layout)"
)


class Layout:
    """G prompt groups packed as ``[prompt | response 1 | ... | response N]``, group after group;
    or, built with :meth:`Layout.tree`, a forest of prefix-tree segments (a prompt/response layout
    is its depth-two case).

    Args:
        prefix_lens: ``P_g`` for each group (prompt tokens, >= 0).
        response_lens: for each group, the list ``[R_g1, ..., R_gN]`` of its response lengths
            (N >= 0, each R >= 0). Empty groups, P = 0, N = 0 and R = 0 are legal.
        device: where the layout's metadata tensors live; it must be the device of the q/k/v
            passed to :func:`dualkv.attention`. The metadata is built once, here, so attention
            calls make no host synchronisation.

    Raises ``TypeError``/``ValueError`` naming the argument for wrong nesting, negative lengths,
    or totals beyond the int32 range.
    """

    # Cache: the last position-id tensor that
    # dualkv.integrations.transformers.check_positions accepted for this layout.
    _checked_positions: Any = None

    @eager_only
    def __init__(
        self,
        prefix_lens: Sequence[int] | torch.Tensor,
        response_lens: Sequence[Sequence[int]],
        device: torch.device | str | None = None,
    ) -> None:
        prefix = _int_list(prefix_lens, "prefix_lens")
        if isinstance(response_lens, (str, bytes)) or not isinstance(response_lens, Sequence):
            raise TypeError(
                "response_lens must be a list with one list of response lengths per group, got "
                f"{type(response_lens).__name__}"
            )
        responses = [_int_list(r, f"response_lens[{g}]") for g, r in enumerate(response_lens)]
        if len(prefix) != len(responses):
            raise ValueError(
                f"prefix_lens has {len(prefix)} groups but response_lens has {len(responses)}; "
                "give one list of response lengths per prompt"
            )
        self._prefix_lens: tuple[int, ...] | None = tuple(prefix)
        self._response_lens: tuple[tuple[int, ...], ...] | None = tuple(tuple(r) for r in responses)
        # The depth-two forest: each prompt a root, its responses its children.
        parents: list[int] = []
        for rs in responses:
            parents += [-1] + [len(parents)] * len(rs)
        self._parents = tuple(parents)
        self._lengths = tuple(x for p, rs in zip(prefix, responses) for x in (p, *rs))
        self._unshared = sum(p * len(r) + sum(r) for p, r in zip(prefix, responses))
        counts = [len(r) for r in responses]
        flat = [x for r in responses for x in r]
        self._set_tables(ops.layout_tables(prefix, counts, flat), device)

    @classmethod
    @eager_only
    def tree(
        cls,
        parents: Sequence[int] | torch.Tensor,
        lengths: Sequence[int] | torch.Tensor,
        device: torch.device | str | None = None,
    ) -> Layout:
        """A forest of prefix-tree segments, listed in packed order.

        Segment ``i`` holds ``lengths[i]`` consecutive packed tokens; its parent is segment
        ``parents[i]`` (an earlier one: ``parents[i] < i``) or ``-1`` for a root. The order need
        not be depth-first (``parents=[-1, 0, 0, 1]`` is breadth-first). A token attends to every
        token of its ancestor segments and causally within its own segment; logical positions
        continue from the parent's end, so each root-to-leaf path is an ordinary row to RoPE (and
        to a sliding window). Empty segments are legal (an empty one's children hang from its
        nearest non-empty ancestor).

        Args:
            parents: the parent index of each segment, ``-1`` for a root.
            lengths: the tokens of each segment (>= 0).
            device: where the metadata tensors live (the device of q/k/v), as for ``Layout``.

        Raises ``TypeError``/``ValueError`` naming the argument for non-int entries, mismatched
        sizes, a parent that is not an earlier segment, negative lengths, or positions or a total
        beyond the int32 range.

        Example: a 4096-token system prompt, two branches, and a child of the first branch::

            dualkv.Layout.tree(parents=[-1, 0, 0, 1], lengths=[4096, 700, 512, 300])
        """
        par = _parent_list(parents, "parents")
        lens = _int_list(lengths, "lengths")
        if len(par) != len(lens):
            raise ValueError(
                f"parents has {len(par)} entries but lengths has {len(lens)}; give one parent "
                "per segment"
            )
        self = object.__new__(cls)
        self._prefix_lens = self._response_lens = None
        self._parents, self._lengths = tuple(par), tuple(lens)
        *tables, self._unshared = ops.tree_tables(par, lens)
        self._set_tables(tuple(tables), device)
        return self

    def _set_tables(
        self, tables: Sequence[torch.Tensor], device: torch.device | str | None
    ) -> None:
        self._host_tables = tuple(tables)
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._place_tables()

    def _place_tables(self) -> None:
        """The tables on the layout's device, their sizes marked as changing per batch."""
        segments, *others = (t.to(self._device) for t in self._host_tables)
        # One segment is common (a trajectory's per-turn samples pack as one); torch.compile
        # specialises sizes 0 and 1 of merely dynamic sizes, so this one is unbacked: one graph.
        self.segments = mark_per_batch(segments, 0, unbacked=True)
        self.query_tiles, self.key_tiles, self.position_ids = (mark_per_batch(t, 0) for t in others)

    def _depth_two(self, name: str) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        if self._prefix_lens is None or self._response_lens is None:
            raise ValueError(
                f"Layout.{name}: a tree layout (Layout.tree) has no prompt groups; it has "
                "parents and lengths instead"
            )
        return self._prefix_lens, self._response_lens

    # --- structure --------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Device of the metadata tensors (and of the tensors attention accepts)."""
        return self._device

    @property
    def is_tree(self) -> bool:
        """True for a layout built with :meth:`Layout.tree`, False for the prompt/response one."""
        return self._prefix_lens is None

    @property
    def parents(self) -> tuple[int, ...]:
        """Parent of each segment (-1 for a root), as given to :meth:`Layout.tree`; for the
        prompt/response layout, its depth-two forest (each prompt followed by its responses)."""
        return self._parents

    @property
    def lengths(self) -> tuple[int, ...]:
        """Tokens of each segment, in the order of :attr:`parents` (empty segments included)."""
        return self._lengths

    @property
    def num_segments(self) -> int:
        """Number of segments in :attr:`parents` / :attr:`lengths` (empty ones included)."""
        return len(self._lengths)

    @property
    def prefix_lens(self) -> tuple[int, ...]:
        """Prompt length of each group (a tree layout raises ValueError)."""
        return self._depth_two("prefix_lens")[0]

    @property
    def response_lens(self) -> tuple[tuple[int, ...], ...]:
        """Response lengths of each group (a tree layout raises ValueError)."""
        return self._depth_two("response_lens")[1]

    @property
    def num_groups(self) -> int:
        """Number of prompt groups G (a tree layout raises ValueError)."""
        return len(self._depth_two("num_groups")[0])

    @property
    def num_responses(self) -> int:
        """Total number of responses over all groups (a tree layout raises ValueError)."""
        return sum(len(r) for r in self._depth_two("num_responses")[1])

    @property
    def total_tokens(self) -> int:
        """Packed tokens T: the sum of all segment lengths (P + sum(R) over the groups).

        (A size of the layout's ``position_ids``: symbolic under torch.compile, so that a compiled
        graph is not specialised to one layout's T.)
        """
        return self.position_ids.shape[0]

    @property
    def unshared_tokens(self) -> int:
        """Tokens of the standard layout: one row of P + R_i per response; for a tree, one row
        per root-to-leaf path (a leaf of :attr:`parents`, empty ones included)."""
        return self._unshared

    @property
    def token_reduction(self) -> float:
        """rho = unshared tokens / packed tokens (1.0 for an empty layout)."""
        t = self.total_tokens
        return self.unshared_tokens / t if t else 1.0

    def allowed_pairs(self, window: int | None = None) -> int:
        """Number of (query, key) pairs the mask allows (with an optional sliding window)."""
        w = check_window(window)
        if self._prefix_lens is None or self._response_lens is None:
            return int(ops.tree_pairs(list(self._parents), list(self._lengths), w))
        counts = [len(r) for r in self._response_lens]
        flat = [x for r in self._response_lens for x in r]
        return int(ops.layout_pairs(list(self._prefix_lens), counts, flat, w))

    def flops(
        self, head_dim: int, num_q_heads: int, window: int | None = None, backward: bool = False
    ) -> float:
        """Useful FLOPs: forward 4 * D * Hq * allowed pairs; backward 2.5x forward."""
        fwd = 4.0 * head_dim * num_q_heads * self.allowed_pairs(window)
        return 2.5 * fwd if backward else fwd

    @eager_only
    def to(self, device: torch.device | str) -> Layout:
        """The same layout with its metadata on ``device``."""
        new = object.__new__(Layout)
        new.__dict__.update(self.__dict__)
        new._device = torch.device(device)
        new._place_tables()
        return new

    def __repr__(self) -> str:
        tail = (
            f"total_tokens={self.total_tokens}, rho={self.token_reduction:.2f}, "
            f"device={self.device})"
        )
        if self.is_tree:
            trees = sum(1 for p in self._parents if p < 0)
            return f"dualkv.Layout.tree(segments={self.num_segments}, roots={trees}, {tail}"
        return f"dualkv.Layout(groups={self.num_groups}, responses={self.num_responses}, {tail}"
