"""The packed LM head of :class:`dualkv.integrations.trl.DualKVGRPOTrainer`:
``model(dualkv_packed=packed, ...)`` returns TRL's fused log-probs output for a packed batch."""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

import torch
from trl.trainer.utils import FusedCausalLMOutput

from ..logprobs import response_logprobs
from ..packing import PackedBatch
from ..prefix_forest import PrefixForest
from . import transformers as dkt

__all__ = ["PACKED_KWARG", "add_packed_lm_head", "token_weights", "tree_row_counts"]

PACKED_KWARG = "dualkv_packed"  # the keyword that routes a model call to the packed forward


def token_weights(packed: PackedBatch) -> torch.Tensor:
    """``[1, T]`` float32: how many rows each packed token stands for (N_g on a prompt, 1 else)
    on a prompt/response layout (a tree's come from its rows: :func:`tree_row_counts`)."""
    layout = packed.layout
    if layout.is_tree:
        raise ValueError(
            "the rows each packed token stands for are not in a tree layout: pass "
            "dualkv_token_weights (DualKVGRPOTrainer does)"
        )
    weights: list[int] = []
    lengths: list[int] = []
    for p, rs in zip(layout.prefix_lens, layout.response_lens, strict=True):
        weights.append(len(rs))
        lengths.append(p)
        weights.extend([1] * len(rs))
        lengths.extend(rs)
    w = torch.repeat_interleave(
        torch.tensor(weights, dtype=torch.float32), torch.tensor(lengths, dtype=torch.int64)
    )
    return w.to(packed.device).view(1, -1)


def tree_row_counts(
    forest: PrefixForest, seq_len: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """``[1, T]`` float32: how many rows hold each packed token of a tree (the rows whose paths
    pass through it: identical rows, and rows ending inside another's path, included), from the
    forest's map of every row token (``seq_len``: each row's real tokens)."""
    index = forest.token_index
    real = torch.arange(index.shape[1])[None, :] < seq_len.to("cpu")[:, None]
    counts = torch.bincount(index[real], minlength=forest.total_tokens)
    return counts.to(device, torch.float32).view(1, -1)


def add_packed_lm_head(
    model: Any, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False
) -> None:
    """Let ``model(dualkv_packed=packed, ...)`` score a :class:`dualkv.PackedBatch`.

    Wraps ``model.forward`` (after TRL's ``add_fused_lm_head``): with ``dualkv_packed`` the
    backbone runs on the packed stream (the model must be in ``attn_implementation="dualkv"``)
    and the call returns TRL's ``FusedCausalLMOutput`` with ``log_probs`` (and ``entropy`` when
    ``dualkv_entropy=True``) in the rows' ``[B, R_max]`` layout, and ``aux_loss`` (the MoE
    load-balancing loss, each packed token weighted by the rows that hold it: read from a
    prompt/response layout, or given as ``dualkv_token_weights`` ``[1, T]``, which a tree needs)
    with ``output_router_logits=True``. Without ``dualkv_packed`` the previous forward runs, so
    generation is unchanged. Calls go through the model's wrappers (DDP), as TRL's own fused head
    does.

    Args:
        model: a transformers causal LM.
        temperature: logits are divided by it (TRL's sampling temperature).
        cast_lm_head_to_fp32: score with float32 hidden states and LM head, outside autocast
            (TRL's ``cast_lm_head_to_fp32``).
    """
    text_config = model.config.get_text_config()
    softcap = dkt.lm_head_softcap(model)
    dkt.check_token_mixers(text_config, model)
    previous = model.forward

    @functools.wraps(type(model).forward)
    def forward(
        self: Any,
        *args: Any,
        dualkv_packed: PackedBatch | None = None,
        dualkv_entropy: bool = False,
        dualkv_token_weights: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        if dualkv_packed is None:
            return previous(*args, **kwargs)
        packed = dualkv_packed
        for name, value in kwargs.items():  # wrappers (PEFT) pass their own arguments as None
            if value is not None and name not in ("output_router_logits", "use_cache"):
                raise ValueError(f"a packed forward takes no {name!r} (the batch is packed)")
        if args:
            raise ValueError("a packed forward takes no positional arguments")
        router = bool(kwargs.get("output_router_logits"))
        impl = getattr(self.config.get_text_config(), "_attn_implementation", None)
        if impl != dkt.ATTN_IMPLEMENTATION:
            raise RuntimeError(
                f"the packed forward needs attn_implementation='dualkv', the model is in {impl!r}"
            )
        dkt.check_packed_model(self, {}, packed, decoder=self.base_model)
        extra = {"output_router_logits": True} if router else {}
        out = self.base_model(**packed.model_inputs(), **extra)
        hidden = out.last_hidden_state
        head = self.get_output_embeddings()
        weight, bias = head.weight, getattr(head, "bias", None)
        ctx: Any = contextlib.nullcontext()
        if cast_lm_head_to_fp32:
            hidden = hidden.float()
            weight = weight.float()
            bias = bias.float() if bias is not None else None
            ctx = torch.autocast(hidden.device.type, enabled=False)
        with ctx:
            res = response_logprobs(
                hidden, weight, packed, temperature=temperature, return_entropy=dualkv_entropy,
                lm_head_bias=bias, logit_softcap=softcap,
            )  # fmt: skip
        logp, ent = res if isinstance(res, tuple) else (res, None)
        aux = None
        if router:
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

            value = load_balancing_loss_func(
                getattr(out, "router_logits", None),
                text_config.num_experts,
                text_config.num_experts_per_tok,
                token_weights(packed) if dualkv_token_weights is None else dualkv_token_weights,
            )
            if not isinstance(value, torch.Tensor):
                raise RuntimeError(
                    f"{type(self).__name__} returned no router logits for the MoE auxiliary loss"
                )
            aux = value
        return FusedCausalLMOutput(
            log_probs=logp, entropy=ent, label_mask=packed.response_mask, aux_loss=aux
        )

    model.forward = types.MethodType(forward, model)
