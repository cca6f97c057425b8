"""The veRL engine's packed model call: ``model(dualkv_packed=...)`` runs the decoder on the packed
stream (or this rank's Ulysses shard) and the LM head on the response tokens only."""

from __future__ import annotations

from typing import Any

import torch

from .. import parallel as _sp
from ..logprobs import response_logprobs
from ..packing import PackedBatch
from . import transformers as _hf
from .verl_errors import unsupported

__all__ = ["ENTROPY_KW", "GRAD_SCALE_KW", "PACKED_KW", "TEMP_KW", "install_packed_forward"]

PACKED_KW = "dualkv_packed"
TEMP_KW = "dualkv_temperature"
ENTROPY_KW = "dualkv_entropy"
GRAD_SCALE_KW = "dualkv_grad_scale"


def install_packed_forward(model: Any) -> None:
    """Let ``model(dualkv_packed=...)`` run the decoder packed and the LM head on responses.

    Instance attributes (this model only): the causal LM's ``forward`` and its output embedding's
    ``forward`` take the DualKV keywords and fall back to the original forward without them. The
    LM head's log-probs are computed inside the head module's own call, so FSDP (1 or 2) has its
    weight gathered there and registers its backward hooks on the outputs.
    """
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise unsupported(f"a model without an LM head ({type(model).__name__})")
    lm_forward = model.forward
    head_forward = head.forward
    softcap = _hf.lm_head_softcap(model)
    _hf.check_token_mixers(_hf.text_config_of(model), model)

    def packed_head(
        hidden: torch.Tensor,
        dualkv_packed: PackedBatch | _sp.ShardedBatch | None = None,
        dualkv_temperature: float = 1.0,
        dualkv_entropy: bool = False,
        dualkv_grad_scale: float = 1.0,
    ) -> Any:
        if dualkv_packed is None:
            return head_forward(hidden)
        bias = getattr(head, "bias", None)
        out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
        if isinstance(dualkv_packed, _sp.ShardedBatch):
            # Ulysses: this rank scores the tokens predicted from its shard; the ranks' disjoint
            # parts are summed, so every rank holds the whole [B, R_max] (see dualkv.parallel)
            out = _sp.response_logprobs(
                hidden, head.weight, dualkv_packed, temperature=dualkv_temperature,
                return_entropy=dualkv_entropy, lm_head_bias=bias, logit_softcap=softcap,
                grad_scale=dualkv_grad_scale,
            )  # fmt: skip
        else:
            out = response_logprobs(
                hidden, head.weight, dualkv_packed, temperature=dualkv_temperature,
                return_entropy=dualkv_entropy, lm_head_bias=bias, logit_softcap=softcap,
            )  # fmt: skip
        # fresh tensors (not views) for FSDP2's output hooks
        return tuple(t.clone() for t in out) if isinstance(out, tuple) else (out.clone(),)

    def packed_lm(*args: Any, **kwargs: Any) -> Any:
        packed = kwargs.pop(PACKED_KW, None)
        if packed is None:
            return lm_forward(*args, **kwargs)
        temperature = kwargs.pop(TEMP_KW, 1.0)
        entropy = bool(kwargs.pop(ENTROPY_KW, False))
        grad_scale = float(kwargs.pop(GRAD_SCALE_KW, 1.0))
        if isinstance(packed, _sp.ShardedBatch):  # this rank's token shard (Ulysses)
            # the guards of every packed forward, on the global batch (length-dependent RoPE,
            # Llama 4's attention temperature, ...), as packed_hidden_states runs them
            _hf.check_packed_model(model, {}, packed.packed)
            out = _hf.decoder_of(model)(**packed.model_inputs())
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        else:
            hidden = _hf.packed_hidden_states(model, packed)
        # the head as the model holds it now: FSDP1 may have wrapped it in a unit of its own
        # (a size-based wrap policy) after this forward was installed, and only a call through
        # that wrapper gathers its weight and hooks its gradient
        return model.get_output_embeddings()(
            hidden, dualkv_packed=packed, dualkv_temperature=temperature, dualkv_entropy=entropy,
            dualkv_grad_scale=grad_scale,
        )  # fmt: skip

    head.forward = packed_head
    model.forward = packed_lm
