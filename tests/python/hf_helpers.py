"""Tiny random HF models and GRPO batches for the training-path tests (no hub access)."""

from __future__ import annotations

import random

import torch

VOCAB = 131


def tiny_config(family: str, window: int = 5, head_dim: int = 16) -> object:
    """A tiny random config of ``family`` (qwen3, llama, gemma3, qwen3-sliding, gemma2)."""
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


def rows_attention(family: str) -> str:
    """The attention of the unshared reference rows (HF SDPA; eager where SDPA cannot softcap)."""
    return "eager" if family == "gemma2" else "sdpa"


def tiny_model(
    family: str, dtype: torch.dtype = torch.float32, seed: int = 0, head_dim: int = 16
) -> torch.nn.Module:
    """A tiny random causal LM; its weights are scaled up a little so logits are not flat."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(family, head_dim=head_dim)
    impl = rows_attention(family)
    config._attn_implementation = impl
    model = AutoModelForCausalLM.from_config(config, attn_implementation=impl)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08 if "embed" not in name else 0.5)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
            else:  # norm weights: vary them around their init
                p.add_(torch.randn_like(p) * 0.1)
    return model.to(dtype)


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
