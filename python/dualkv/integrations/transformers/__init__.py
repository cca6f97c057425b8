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

The modules, by role: ``attention_backend`` (the attention function, :func:`use_layout`,
:func:`register`), ``mask`` (the mask function), ``positions`` (:func:`check_positions`),
``token_mixers`` and ``model_guards`` (what a model must be for a packed forward),
``model_parts`` (a model's decoder, text config and LM head), ``logprobs`` (response log-probs:
packed, rows, sequence-parallel) and ``checkpointing``. Every public name is importable from here.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as e:  # the integration is an extra
    raise ImportError(
        "dualkv.integrations.transformers needs Hugging Face transformers: pip install "
        "'dualkv[transformers]' (or pip install transformers)"
    ) from e

from .attention_backend import (
    ATTN_IMPLEMENTATION,
    DETERMINISTIC_KWARG,
    LAYOUT_KWARG,
    current_layout,
    dualkv_attention_forward,
    register,
    use_layout,
)
from .checkpointing import checkpoint_kwargs, enable_gradient_checkpointing
from .logprobs import (
    packed_hidden_states,
    packed_response_logprobs,
    rows_response_logprobs,
    sequence_parallel_logprobs,
)
from .mask import LocalMask, dualkv_mask
from .model_guards import (
    MULTIMODAL_ARGS,
    check_packed_model,
    check_rope_length,
    refuse_multimodal,
    relative_positions_only,
)
from .model_parts import decoder_of, lm_head_of, lm_head_softcap, text_config_of
from .positions import check_positions
from .token_mixers import check_token_mixers

__all__ = [
    "ATTN_IMPLEMENTATION",
    "DETERMINISTIC_KWARG",
    "LAYOUT_KWARG",
    "MULTIMODAL_ARGS",
    "LocalMask",
    "check_packed_model",
    "check_positions",
    "check_rope_length",
    "check_token_mixers",
    "checkpoint_kwargs",
    "current_layout",
    "decoder_of",
    "dualkv_attention_forward",
    "dualkv_mask",
    "enable_gradient_checkpointing",
    "lm_head_of",
    "lm_head_softcap",
    "packed_hidden_states",
    "packed_response_logprobs",
    "refuse_multimodal",
    "register",
    "relative_positions_only",
    "rows_response_logprobs",
    "sequence_parallel_logprobs",
    "text_config_of",
    "use_layout",
]

register()
