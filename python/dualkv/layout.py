"""The shared-prompt layout of a micro-batch (dualkv.Layout)."""

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


def _int_list(value: Any, name: str) -> list[int]:
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
        if int(x) > _MAX_LEN:  # (negative lengths are reported by the C++ core ...)
            raise ValueError(f"{name}[{i}] = {int(x)} exceeds the int32 range of the layout")
        if int(x) < -_MAX_LEN:  # (... where they fit its int64 arguments)
            raise ValueError(f"{name}[{i}] = {int(x)} is negative")
        out.append(int(x))
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


def mark_per_batch(t: torch.Tensor, *dims: int) -> torch.Tensor:
    """Tells torch.compile that sizes ``dims`` of ``t`` change from batch to batch, so the first
    compilation is already dynamic in them (instead of a static graph, then a recompilation).

    A hint only (sizes 0 and 1 may still be specialised), and only once torch.compile is in use
    (dynamo imported): eager code pays nothing.
    """
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        for d in dims:
            dynamo.maybe_mark_dynamic(t, d)
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
    """G prompt groups packed as ``[prompt | response 1 | ... | response N]``, group after group.

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
        self._prefix_lens = tuple(prefix)
        self._response_lens = tuple(tuple(r) for r in responses)
        counts = [len(r) for r in responses]
        flat = [x for r in responses for x in r]
        tables = ops.layout_tables(prefix, counts, flat)
        self._host_tables = tables
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self.segments, self.query_tiles, self.key_tiles, self.position_ids = (
            mark_per_batch(t.to(self._device), 0) for t in tables
        )

    # --- structure --------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Device of the metadata tensors (and of the tensors attention accepts)."""
        return self._device

    @property
    def prefix_lens(self) -> tuple[int, ...]:
        """Prompt length of each group."""
        return self._prefix_lens

    @property
    def response_lens(self) -> tuple[tuple[int, ...], ...]:
        """Response lengths of each group."""
        return self._response_lens

    @property
    def num_groups(self) -> int:
        """Number of prompt groups G."""
        return len(self._prefix_lens)

    @property
    def num_responses(self) -> int:
        """Total number of responses over all groups."""
        return sum(len(r) for r in self._response_lens)

    @property
    def total_tokens(self) -> int:
        """Packed tokens T = sum over groups of P + sum(R).

        (A size of the layout's ``position_ids``: symbolic under torch.compile, so that a compiled
        graph is not specialised to one layout's T.)
        """
        return self.position_ids.shape[0]

    @property
    def unshared_tokens(self) -> int:
        """Tokens of the standard layout: one row of P + R_i per response."""
        return sum(p * len(r) + sum(r) for p, r in zip(self._prefix_lens, self._response_lens))

    @property
    def token_reduction(self) -> float:
        """rho = unshared tokens / packed tokens (1.0 for an empty layout)."""
        t = self.total_tokens
        return self.unshared_tokens / t if t else 1.0

    def allowed_pairs(self, window: int | None = None) -> int:
        """Number of (query, key) pairs the mask allows (with an optional sliding window)."""
        counts = [len(r) for r in self._response_lens]
        flat = [x for r in self._response_lens for x in r]
        return int(ops.layout_pairs(list(self._prefix_lens), counts, flat, check_window(window)))

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
        new.segments, new.query_tiles, new.key_tiles, new.position_ids = (
            mark_per_batch(t.to(new._device), 0) for t in self._host_tables
        )
        return new

    def __repr__(self) -> str:
        return (
            f"dualkv.Layout(groups={self.num_groups}, responses={self.num_responses}, "
            f"total_tokens={self.total_tokens}, rho={self.token_reduction:.2f}, "
            f"device={self.device})"
        )
