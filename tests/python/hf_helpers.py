"""Tiny random HF models and GRPO batches for the training-path tests (no hub access)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

VOCAB = 131


def tiny_config(family: str, window: int = 5, head_dim: int = 16) -> object:
    """A tiny random config of ``family`` (qwen3, llama, gemma3, qwen3-sliding, gemma2, and the
    Gemma 4 text variants of :func:`gemma4_config`)."""
    if family.startswith("gemma4"):
        return gemma4_config(family, window=window, head_dim=head_dim)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
    )
    if family == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(num_hidden_layers=2, tie_word_embeddings=True, **common)
    if family == "qwen3-sliding":
        from transformers import Qwen3Config

        return Qwen3Config(
            num_hidden_layers=2,
            use_sliding_window=True,
            sliding_window=window,
            max_window_layers=1,
            layer_types=["full_attention", "sliding_attention"],
            **common,
        )
    if family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(num_hidden_layers=2, attention_bias=True, mlp_bias=True, **common)
    if family == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(
            num_hidden_layers=3,
            sliding_window=window,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=16,
            final_logit_softcapping=15.0,
            **common,
        )
    if family == "gemma2":  # attention logit soft-capping + sliding window
        from transformers import Gemma2Config

        return Gemma2Config(
            num_hidden_layers=2,
            sliding_window=window,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=16,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=10.0,
            **common,
        )
    raise ValueError(family)


EMBED_STD = 0.15
GEMMA4_FAMILIES = ("gemma4", "gemma4-keqv", "gemma4-shared", "gemma4-ple", "gemma4-moe")


def gemma4_config(
    family: str = "gemma4",
    window: int = 5,
    head_dim: int = 16,
    global_head_dim: int | None = None,
    heads: int = 4,
    kv_heads: int = 2,
    global_kv_heads: int = 1,
    hidden: int = 64,
    **overrides: object,
) -> object:
    """A tiny random Gemma 4 text config (transformers' ``Gemma4TextConfig``).

    Sliding layers have ``head_dim``, full layers ``global_head_dim`` (2x by default), with the
    proportional partial RoPE of the full layers, q/k RMSNorm (``scaling=1.0``) and the final
    logit softcap (3, so that it bends the logits). Variants:

    * ``gemma4``: 4 layers (S F S F), every layer with its own k/v projections;
    * ``gemma4-keqv``: ``attention_k_eq_v`` (full layers without v_proj, ``global_kv_heads``),
      as Gemma-4-31B;
    * ``gemma4-shared``: k_eq_v, 5 layers (S F S S F) of which the last 3 reuse the KV of
      layers 0 and 1 (``num_kv_shared_layers``), double-wide MLP on those;
    * ``gemma4-ple``: gemma4-shared plus per-layer input embeddings (E2B/E4B style);
    * ``gemma4-moe``: k_eq_v and the MoE block next to the MLP (26B-A4B style).

    ``overrides`` are further ``Gemma4TextConfig`` fields.
    """
    from transformers import Gemma4TextConfig

    if family not in GEMMA4_FAMILIES:
        raise ValueError(family)
    layers = ["sliding_attention", "full_attention"] * 2
    extra: dict[str, object] = {"hidden_size_per_layer_input": 0}
    if family in ("gemma4-shared", "gemma4-ple"):
        layers = ["sliding_attention", "full_attention", "sliding_attention",
                  "sliding_attention", "full_attention"]  # fmt: skip
        extra.update(num_kv_shared_layers=3, use_double_wide_mlp=True)
    if family == "gemma4-ple":
        extra.update(hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB)
    if family == "gemma4-moe":
        extra.update(enable_moe_block=True, num_experts=4, top_k_experts=2,
                     moe_intermediate_size=32)  # fmt: skip
    extra.update(overrides)
    return Gemma4TextConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=96,
        num_hidden_layers=len(layers),
        layer_types=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        global_head_dim=global_head_dim or 2 * head_dim,
        num_global_key_value_heads=global_kv_heads,
        attention_k_eq_v=family != "gemma4",
        sliding_window=window,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        final_logit_softcapping=3.0,
        **extra,
    )


def rows_attention(family: str) -> str:
    """The attention of the unshared reference rows (HF SDPA; eager where SDPA cannot softcap)."""
    return "eager" if family == "gemma2" else "sdpa"


def tiny_model(
    family: str,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    head_dim: int = 16,
    config: object | None = None,
) -> torch.nn.Module:
    """A tiny random causal LM (of ``config`` when given, else ``tiny_config(family)``); its
    weights are scaled up a little so logits are not flat."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, head_dim=head_dim) if config is None else config
    impl = rows_attention(family)
    config._attn_implementation = impl
    model = AutoModelForCausalLM.from_config(config, attn_implementation=impl)
    gemma4 = getattr(config, "model_type", "") == "gemma4_text"
    # (Gemma 4 multiplies its embeddings by sqrt(hidden) = 8 and ties the LM head to them: a
    # smaller table keeps the inputs and the logits near unit scale)
    embed_std = EMBED_STD if gemma4 else 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08 if "embed" not in name else embed_std)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
            else:  # norm weights: vary them around their init
                p.add_(torch.randn_like(p) * 0.1)
        if gemma4:
            _temper_scores(model)
    return model.to(dtype)


def _temper_scores(model: torch.nn.Module, score_std: float = 3.0) -> None:
    """Gemma 4 scores are ``q_norm(q) . k_norm(k)`` with scale 1: with unit norm weights their
    spread grows as sqrt(head dim) (16 at D = 256, 23 at D = 512), a near one-hot softmax that no
    trained model has and on which bf16 rounding is chaotic. Scale the q/k norm weights so the
    scores spread about ``score_std`` at every head dim, as learned norm weights do."""
    for layer in model.model.layers:
        attn = layer.self_attn
        factor = (score_std / attn.head_dim**0.5) ** 0.5
        attn.q_norm.weight.mul_(factor)
        if not attn.is_kv_shared_layer:
            attn.k_norm.weight.mul_(factor)


class Float64Throughout(TorchFunctionMode):
    """A float64 model that computes in float64 throughout (a float64 oracle). transformers'
    modules cast to float32 on purpose: RMSNorm (``hidden_states.to(torch.float32)``, Gemma's
    ``.float()``), RoPE (``position_ids.float()``), eager attention (``softmax(...,
    dtype=torch.float32)``); an upcast in a bf16 or fp32 model, but in a float64 one a rounding to
    float32, whose error the gradients of a tiny Gemma 4 with per-layer inputs amplify to 1e-4 of
    their scale, as much as a float32 step's own. Inside this mode such a cast of a float64 or
    integer tensor gives float64 (the packed and rows gradients of a float64 model then agree to
    1e-13 instead of 3e-8)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = dict(kwargs or {})
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is not None and (x.dtype == torch.float64 or not x.is_floating_point()):
            if func is torch.Tensor.float:
                return x.double()
            if func is torch.Tensor.to:
                args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


def random_groups(
    rng: random.Random,
    groups: int = 3,
    p_range: tuple[int, int] = (3, 20),
    n_range: tuple[int, int] = (1, 4),
    r_range: tuple[int, int] = (1, 14),
) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Random prompts and uneven responses (token lists)."""
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(*p_range))] for _ in range(groups)]
    responses = [
        [
            [rng.randrange(VOCAB) for _ in range(rng.randint(*r_range))]
            for _ in range(rng.randint(*n_range))
        ]
        for _ in range(groups)
    ]
    return prompts, responses


def shuffled_rows(
    rng: random.Random, prompts: list[list[int]], responses: list[list[list[int]]]
) -> tuple[torch.Tensor, torch.Tensor, int, list[str]]:
    """veRL-style rows (pads filled with random ids) in shuffled order with string group ids."""
    from dualkv.packing import rows_from_lists

    ids, mask, pw, gid = rows_from_lists(prompts, responses)
    perm = list(range(ids.shape[0]))
    rng.shuffle(perm)
    ids, mask, gid = ids[perm], mask[perm], gid[perm]
    junk = torch.randint(0, VOCAB, ids.shape)
    ids = torch.where(mask.bool(), ids, junk)  # pad ids must never be read
    return ids, mask, pw, [f"uid-{g}" for g in gid.tolist()]


def tree_rows(rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Multi-turn / branching rows: a random token tree (turns that branch), rows = the paths to
    random nodes (inner nodes too: per-turn samples, each a prefix of the next), each split into
    prompt | response at a random token."""
    from dualkv.packing import rows_from_lists

    nodes = [([rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))], -1)]
    for _ in range(rng.randint(3, 12)):
        parent = rng.randrange(len(nodes))
        nodes.append(([rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))], parent))
    prompts, responses = [], []
    for _ in range(rng.randint(2, 8)):
        n = rng.randrange(len(nodes))
        path = []
        while n >= 0:
            path.append(nodes[n][0])
            n = nodes[n][1]
        tokens = [t for seg in path[::-1] for t in seg]
        # the prompt | response cut anywhere (an empty prompt too), not only at branch points
        cut = rng.randint(0, len(tokens) - 1)
        prompts.append(tokens[:cut])
        responses.append([tokens[cut:]])
    if not any(prompts):  # (the rows reference reads the response's predictor at column pw - 1)
        prompts[0], responses[0] = prompts[0] + responses[0][0][:1], [responses[0][0][1:]]
    ids, mask, pw, _ = rows_from_lists(prompts, responses)
    junk = torch.randint(0, VOCAB, ids.shape)
    return torch.where(mask.bool(), ids, junk), mask, pw


@contextlib.contextmanager
def compiled_layers(
    model: torch.nn.Module, backend: str, keep_attention: bool = True
) -> Iterator[torch.nn.Module]:
    """Gradient checkpointing on and every decoder layer through torch.compile (regional
    compilation, as trainers do) inside the block; both undone, dynamo's caches cleared, after.

    With dynamo's skip_fwd_side_effects_in_bwd_under_checkpoint, as trainers set for regional
    compilation under checkpointing: transformers' hub-kernel wrapper (where `kernels` is
    installed, a dependency of transformers 5.25) sets a global in every attention forward, a side
    effect dynamo otherwise refuses inside a checkpoint, running the whole layer uncompiled."""
    import torch._dynamo

    from dualkv.integrations.transformers import enable_gradient_checkpointing

    enable_gradient_checkpointing(model, keep_attention=keep_attention)
    skip = "skip_fwd_side_effects_in_bwd_under_checkpoint"
    try:
        for layer in model.model.layers:
            layer.compile(backend=backend)
        with torch._dynamo.config.patch(
            **({skip: True} if hasattr(torch._dynamo.config, skip) else {})
        ):
            yield model
    finally:
        model.gradient_checkpointing_disable()
        torch._dynamo.reset()
