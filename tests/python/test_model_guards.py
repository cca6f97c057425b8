"""Models the packed path cannot run exactly raise, naming what they do, instead of giving other
log-probs than their rows (each case was a silent wrong answer: packed vs rows log-probs 0.02-28
apart on tiny random models). Controls: the same families without the feature agree with their
rows, so the error is not raised for what works.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

import transformers as T  # noqa: E402

import dualkv  # noqa: E402
from dualkv.integrations import transformers as dkt  # noqa: E402
from hf_helpers import VOCAB  # noqa: E402

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=512, pad_token_id=0,
)  # fmt: skip


def _model(config: object, seed: int, impl: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()
    with torch.no_grad():  # weights large enough that every feature moves the log-probs
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5 if "embed" in name else 0.08)
    return model


def _rows(seed: int) -> tuple[torch.Tensor, torch.Tensor, int, list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (7, 9)]
    responses = [
        [[rng.randrange(3, VOCAB) for _ in range(k)] for k in (5, 8, 2)],
        [[rng.randrange(3, VOCAB) for _ in range(k)] for k in (6, 1)],
    ]
    return dualkv.rows_from_lists(prompts, responses, pad_id=0)


def _packed_vs_rows(model: torch.nn.Module, seed: int, rows_impl: str = "sdpa") -> float:
    ids, mask, pw, gid = _rows(seed)
    model.set_attn_implementation(rows_impl)
    lp_rows = dkt.rows_response_logprobs(model, ids, mask, pw)
    model.set_attn_implementation("dualkv")
    pk = dualkv.pack(ids, mask, pw, gid)
    try:
        lp = dkt.packed_response_logprobs(model, pk)
    finally:
        model.set_attn_implementation(rows_impl)
    return (lp - lp_rows).abs().max().item()


@pytest.mark.parametrize(
    "config",
    [
        T.CohereConfig(logit_scale=0.0625, **COMMON),
        T.GraniteConfig(logits_scaling=8.0, **COMMON),
    ],
    ids=["cohere", "granite"],
)
def test_scaled_logits_raise(config: object, seed: int) -> None:
    with pytest.raises(NotImplementedError, match="scales its logits"):
        _packed_vs_rows(_model(config, seed), seed)


def _qwen2_moe(sliding: bool, window: int) -> object:
    return T.Qwen2MoeConfig(
        use_sliding_window=sliding, sliding_window=window, max_window_layers=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, **COMMON,
    )  # fmt: skip


def test_window_in_the_mask_only_raises(seed: int) -> None:
    """Qwen2-MoE's use_sliding_window reaches the mask, not the attention call."""
    with pytest.raises(NotImplementedError, match="limits attention to 4 tokens"):
        _packed_vs_rows(_model(_qwen2_moe(True, 4), seed), seed)
    # controls: no window, and a window longer than the packed stream (it changes nothing)
    assert _packed_vs_rows(_model(_qwen2_moe(False, 4), seed), seed) < 1e-4
    assert _packed_vs_rows(_model(_qwen2_moe(True, 4096), seed), seed) < 1e-4


def test_chunked_attention_raises(seed: int) -> None:
    def config(chunk: int) -> object:
        return T.Llama4TextConfig(
            **{**COMMON, "intermediate_size": 64}, intermediate_size_mlp=96, head_dim=16,
            num_local_experts=2, attention_chunk_size=chunk, no_rope_layers=[1, 0],
            moe_layers=[],
        )  # fmt: skip

    with pytest.raises(NotImplementedError, match="limits attention to 4 tokens"):
        _packed_vs_rows(_model(config(4), seed), seed)
    assert _packed_vs_rows(_model(config(10000), seed), seed) < 1e-4


def test_window_passed_to_the_attention_still_runs(seed: int) -> None:
    """Mistral passes its window to the attention as well as to the mask: it runs, exactly."""
    config = T.MistralConfig(sliding_window=4, head_dim=16, **COMMON)
    assert _packed_vs_rows(_model(config, seed), seed) < 1e-4


def test_attention_sinks_raise(seed: int) -> None:
    config = T.GptOssConfig(
        **{**COMMON, "intermediate_size": 32}, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="attention sinks"):
        _packed_vs_rows(_model(config, seed, "eager"), seed, "eager")


@pytest.mark.parametrize("family", ["qwen3_next", "lfm2", "falcon_h1"])
def test_hybrid_token_mixers_raise(family: str, seed: int) -> None:
    """Linear attention, short convolutions and Mamba mixers would run along the packed stream."""
    if family == "qwen3_next":
        config = T.Qwen3NextConfig(
            **COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=32, head_dim=16,
            layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        )  # fmt: skip
    elif family == "lfm2":
        config = T.Lfm2Config(**COMMON, layer_types=["conv", "full_attention"])
    else:
        config = T.FalconH1Config(
            **COMMON, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
            mamba_n_groups=1, mamba_chunk_size=16,
        )  # fmt: skip
    with pytest.raises(NotImplementedError, match="mixes tokens otherwise"):
        _packed_vs_rows(_model(config, seed), seed)


@pytest.mark.parametrize("layers", ["sliding+full", "full"])
def test_two_way_image_blocks_raise(layers: str, seed: int) -> None:
    """Gemma 3 with image tokens (token_type_ids): transformers lets an image's tokens see each
    other both ways (an or-overlay on the causal mask, Gemma 3 and PaliGemma); the packed causal
    attention would drop it (log-probs 0.07 apart before). Text-only batches still run."""
    image = 7
    types = (
        ["sliding_attention", "full_attention"]
        if layers == "sliding+full"
        else ["full_attention"] * 2
    )
    text = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=512,
        query_pre_attn_scalar=16, layer_types=types, max_position_embeddings=512,
    )  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    config = T.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                            image_token_id=image, boi_token_id=8, eoi_token_id=9)  # fmt: skip
    torch.manual_seed(seed)
    model = T.Gemma3ForConditionalGeneration(config).eval()
    model.set_attn_implementation("dualkv")
    rng = random.Random(seed)
    prompt = [rng.randrange(10, VOCAB) for _ in range(3)] + [8] + [image] * 4 + [9]
    pk = dualkv.pack(prompts=[prompt], responses=[[[11, 12, 13], [14, 15]]])
    with torch.no_grad():
        with pytest.raises(ValueError, match="attend to later ones"):
            model.model(**pk.model_inputs(), token_type_ids=(pk.input_ids == image).long())
        model.model(**pk.model_inputs(), token_type_ids=torch.zeros_like(pk.input_ids))


def test_decoder_without_position_ids_raises(seed: int) -> None:
    """Bart-family decoders (BartForCausalLM, MBart, Marian, Pegasus, Blenderbot) number their
    tokens 0..T-1 themselves: packed responses got their place in the stream as learned
    absolute positions (log-probs up to 8.8 apart)."""
    config = T.BartConfig(
        vocab_size=VOCAB, d_model=64, decoder_layers=2, encoder_layers=1,
        decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=96,
        encoder_ffn_dim=96, max_position_embeddings=512, pad_token_id=0, dropout=0.0,
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="takes no position_ids"):
        _packed_vs_rows(_model(config, seed, "eager"), seed, "eager")


def test_hand_written_attention_raises(seed: int) -> None:
    """GIT's text layers compute attention themselves and only add the mask, which "dualkv"
    drops: they attended over the whole packed stream (log-probs 0.18 apart)."""
    config = T.GitConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=96, max_position_embeddings=512, pad_token_id=0,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="compute attention themselves"):
        _packed_vs_rows(_model(config, seed, "eager"), seed, "eager")


def test_length_dependent_rope_raises(seed: int) -> None:
    """Dynamic NTK RoPE takes its frequencies from the batch's largest position once it passes
    max_position_embeddings: the packed stream's differs from each row's."""

    def config(max_positions: int) -> object:
        rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
        return T.LlamaConfig(
            **{**COMMON, "max_position_embeddings": max_positions}, rope_parameters=rope
        )

    with pytest.raises(NotImplementedError, match="'dynamic' RoPE scaling"):
        _packed_vs_rows(_model(config(12), seed), seed)
    assert _packed_vs_rows(_model(config(512), seed), seed) < 1e-4  # below it: the plain RoPE


def test_attention_temperature_tuning_raises(seed: int) -> None:
    """Llama 4's NoPE layers scale queries by the token's index once it reaches floor_scale: the
    packed stream's index, not the row's position."""

    def config(floor: int) -> object:
        return T.Llama4TextConfig(
            **{**COMMON, "intermediate_size": 64}, intermediate_size_mlp=96, head_dim=16,
            num_local_experts=2, attention_chunk_size=10000, no_rope_layers=[1, 0],
            moe_layers=[], attn_temperature_tuning=True, floor_scale=floor,
        )  # fmt: skip

    with pytest.raises(NotImplementedError, match="attn_temperature_tuning"):
        _packed_vs_rows(_model(config(4), seed), seed)
    assert _packed_vs_rows(_model(config(8192), seed), seed) < 1e-4


def _shift_changes_logits(model: torch.nn.Module, seed: int, shift: int) -> float:
    """Largest logit change (fp64) when every position of a row moves by ``shift``: the oracle
    of :func:`relative_positions_only` (TRL's trees number rows from 0 instead of after their
    left padding, which is such a shift)."""
    torch.manual_seed(seed)
    ids = torch.randint(3, VOCAB, (1, 12))
    pos = torch.arange(12)[None]
    model = model.double()
    with torch.no_grad():
        a = model(ids, position_ids=pos).logits
        b = model(ids, position_ids=pos + shift).logits
    return (a - b).abs().max().item()


def _ministral3(beta: float) -> object:
    rope = {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
        "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": beta,
    }  # fmt: skip
    return T.Ministral3Config(**COMMON, head_dim=16, rope_parameters=rope)


@pytest.mark.parametrize(
    "name,config,relative",
    [
        ("qwen3", lambda: T.Qwen3Config(**COMMON, head_dim=16), True),
        ("ministral3 without the query scale", lambda: _ministral3(0.0), True),
        # Ministral 3 / Mistral 4 scale the queries by 1 + beta log(1 + floor(pos / original))
        ("ministral3", lambda: _ministral3(0.1), False),
        (
            "dynamic rope",
            lambda: T.LlamaConfig(
                **{**COMMON, "max_position_embeddings": 16},
                rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
            ),
            False,
        ),
        ("gpt2", lambda: T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4), False),
    ],
)
def test_relative_positions_only_against_a_shift(name: str, config, relative: bool, seed: int):
    """relative_positions_only is True only for models whose outputs a constant shift of a row's
    positions leaves unchanged (shifted past every threshold of the configs above)."""
    model = _model(config(), seed)
    change = _shift_changes_logits(model, seed, shift=40)
    assert (change < 1e-6) == relative, (name, change)
    assert dkt.relative_positions_only(model) == relative, name
