""":class:`PackedBatch`: a micro-batch packed into the shared-prompt layout (what
:func:`dualkv.pack` and :func:`dualkv.tree_packing.pack_rows_tree` return), with the maps back to
its rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .layout import Layout, mark_per_batch

__all__ = ["PackedBatch"]


@dataclass
class PackedBatch:
    """A micro-batch packed into the shared-prompt layout, with the maps back to its rows.

    Shapes: ``T`` packed tokens, ``B`` rows (one per response), ``R_max`` the rows' response
    width, ``M`` real response tokens that have a predicting position (all of them unless a
    prompt is empty: the first token of a response to an empty prompt has no prediction).

    Attributes:
        input_ids: ``[1, T]`` int64 packed token ids.
        position_ids: ``[1, T]`` int64 positions for the model's RoPE (prompt ``0..P-1``, each
            response ``P..P+R-1``; taken from the rows' own position ids when given).
        layout: the :class:`dualkv.Layout` (on the batch's device).
        response_index: ``[B, R_max]`` int64 packed index of response token ``j`` of row ``b``
            (0 on padding).
        response_mask: ``[B, R_max]`` bool, True on the response tokens that are scored: every
            real response token that has a predicting position (the loss mask). The first token
            of a response to an empty prompt (P = 0) has none, so it is False there.
        real_mask: ``[B, R_max]`` bool, True on every real response token (padding False).
        response_ids: ``[B, R_max]`` int64 response token ids (0 on padding).
        row_group: ``[B]`` int64 index of each row's group in the layout.
        token_rows: ``[M]`` int64 flat index ``b * R_max + j`` of each predicted response token.
        token_sources: ``[M]`` int64 packed index of the hidden state that predicts the token
            (the prompt's last position for ``j = 0``: one row of N labels per group).
        token_labels: ``[M]`` int64 the token ids to score.
        group_rows: for each group in layout order, the indices of its rows (host tuple).
        num_rows: ``B``.
        max_response_len: ``R_max``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    layout: Layout
    response_index: torch.Tensor
    response_mask: torch.Tensor
    real_mask: torch.Tensor
    response_ids: torch.Tensor
    row_group: torch.Tensor
    token_rows: torch.Tensor
    token_sources: torch.Tensor
    token_labels: torch.Tensor
    group_rows: tuple[tuple[int, ...], ...]
    num_rows: int
    max_response_len: int

    def __post_init__(self) -> None:
        # Every size here changes from batch to batch (see dualkv.layout.mark_per_batch).
        for t in (self.input_ids, self.position_ids):
            mark_per_batch(t, 1)
        for t in (self.response_index, self.response_mask, self.real_mask, self.response_ids):
            mark_per_batch(t, 0, 1)
        for t in (self.row_group, self.token_rows, self.token_sources, self.token_labels):
            mark_per_batch(t, 0)

    @property
    def total_tokens(self) -> int:
        """Packed token count ``T``."""
        return self.layout.total_tokens

    @property
    def num_response_tokens(self) -> int:
        """Number of response tokens with a prediction (``M``)."""
        return int(self.token_rows.numel())

    @property
    def device(self) -> torch.device:
        """Device of the packed tensors."""
        return self.input_ids.device

    @property
    def token_reduction(self) -> float:
        """rho = tokens of the standard rows (P + R_i each) / packed tokens."""
        return self.layout.token_reduction

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments for a HF model forward with ``attn_implementation="dualkv"``."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "dualkv_layout": self.layout,
            "use_cache": False,
        }

    def gather_responses(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token packed values ``[T, ...]`` (or ``[1, T, ...]``) to rows ``[B, R_max, ...]``.

        Padding positions are zero (every real response token is gathered, see ``real_mask``).
        Differentiable (a gather and a mask).
        """
        if x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == self.total_tokens:
            x = x[0]
        if x.shape[0] != self.total_tokens:
            raise ValueError(
                f"x must have {self.total_tokens} packed tokens in dim 0, "
                f"got shape {tuple(x.shape)}"
            )
        out = x.index_select(0, self.response_index.reshape(-1))
        out = out.view(self.num_rows, self.max_response_len, *x.shape[1:])
        mask = self.real_mask.view(self.num_rows, self.max_response_len, *([1] * (x.dim() - 1)))
        return torch.where(mask, out, 0)  # (a non-finite value at the gathered pad stays out)

    def scatter_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """Per-scored-token values ``[M]`` (in ``token_rows`` order) to rows ``[B, R_max]``.

        Zeros where no token is scored (padding). Differentiable (an index copy).
        """
        shape = self.response_mask.shape  # [B, R_max] (symbolic under torch.compile)
        flat = values.new_zeros(shape[0] * shape[1]).index_copy(0, self.token_rows, values)
        return flat.view(shape)

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch with every tensor (and the layout) on ``device``."""
        device = torch.device(device)
        fields = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                value = value.to(device)
            elif isinstance(value, Layout):
                value = value.to(device)
            fields[name] = value
        return PackedBatch(**fields)


def batch_from_row_maps(
    input_ids: torch.Tensor,
    prompt_width: int,
    packed_ids: torch.Tensor,
    packed_pos: torch.Tensor,
    layout: Layout,
    response_index: torch.Tensor,
    sources: torch.Tensor,
    has_source: torch.Tensor,
    valid: torch.Tensor,
    row_group: torch.Tensor,
    group_rows: list[list[int]],
) -> PackedBatch:
    """The :class:`PackedBatch` of trainer rows ``input_ids`` ``[B, L]`` from the maps a packer
    built on the host: ``response_index`` / ``sources`` ``[B, R_max]`` (packed index of each
    response token and of the hidden state that predicts it), ``has_source`` (the loss mask),
    ``valid`` (real response tokens), each row's group and each group's rows. Shared by the
    prompt/response packing and the prefix-tree packing."""
    device = input_ids.device
    flat = has_source.reshape(-1).nonzero().flatten()
    response_ids = torch.where(valid.to(device), input_ids[:, prompt_width:].to(torch.int64), 0)
    return PackedBatch(
        input_ids=packed_ids,
        position_ids=packed_pos,
        layout=layout,
        response_index=response_index.to(device),
        response_mask=has_source.to(device),
        real_mask=valid.to(device),
        response_ids=response_ids,
        row_group=row_group.to(device),
        token_rows=flat.to(device),
        token_sources=sources.reshape(-1)[flat].to(device),
        token_labels=response_ids.reshape(-1).index_select(0, flat.to(device)),
        group_rows=tuple(tuple(r) for r in group_rows),
        num_rows=input_ids.shape[0],
        max_response_len=input_ids.shape[1] - prompt_width,
    )
