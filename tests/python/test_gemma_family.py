"""Gemma 2 / 3 / 3n / 4 text variants against an oracle independent of DualKV, in float64.

The oracle is the model itself on each row ``[prompt | response_i]`` alone (batch of one, no
padding, no mask: HF SDPA, or eager where the layers soft-cap their attention logits), scored with
the full-vocabulary log-softmax of the logits the model's own forward returns; the packed path is
``attn_implementation="dualkv"`` with :func:`packed_response_logprobs`. Both take the gradient of
one random weighting of the per-token log-probs. float64 leaves only the float32 steps inside HF's
layers (RMSNorm, eager softmax, MoE router) as noise, ~1e-6 here; any packing error is orders of
magnitude above (a wrong window or source layer moves the log-probs by 1e-2 to 1e1).

Variants the other suites do not cover: windows of 1 and 2 tokens and windows ending on the
prompt/response boundaries, Gemma 4 layer patterns (full first, one layer, every layer full),
shared-KV layers with every kind of source (sliding or full, nearest or farther back, with and
without k_eq_v), full-layer head dims and KV heads (global_head_dim below / equal / above head_dim,
num_global_key_value_heads), RoPE per layer type (proportional partial factors, linear, YaRN,
Llama 3), per-layer input embeddings without shared layers, final-logit softcap off, untied
LM head, temperature, one response, responses and prompts of one token; Gemma 3 and Gemma 2 with
their query_pre_attn_scalar, attention softcap and windows; Gemma 3n (AltUp, LAuReL, shared KV,
activation sparsity); Gemma 3's multimodal class on text.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

import dualkv  # noqa: E402
from dualkv.integrations import transformers as dkt  # noqa: E402
from hf_helpers import VOCAB, gemma4_config, tiny_config, tiny_model  # noqa: E402

S, F = "sliding_attention", "full_attention"
ATOL = 1e-5  # log-probs; gradients: 1e-5 of each parameter's largest gradient


def _layouts(seed: int, low: int = 0) -> list[tuple[list[list[int]], list[list[list[int]]]]]:
    """Uneven groups; then a one-token prompt with a one-token response, and a group of one
    (token ids from ``low``)."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(low, VOCAB) for _ in range(n)]

    mixed = [toks(rng.randint(2, 12)) for _ in range(2)]
    mixed_r = [[toks(rng.randint(2, 8)) for _ in range(rng.randint(2, 3))] for _ in range(2)]
    return [(mixed, mixed_r), ([toks(1), toks(13)], [[toks(6), toks(1)], [toks(9)]])]


def _rows_oracle(model, prompts, responses, temperature, weights, impl):
    """Log-probs [B, R_max] and parameter gradients of sum(weights * logp), each row alone."""
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    rows = [(p, r) for p, rs in zip(prompts, responses, strict=True) for r in rs]
    out = torch.zeros(weights.shape, dtype=torch.float64)
    total = torch.zeros((), dtype=torch.float64)
    for b, (p, r) in enumerate(rows):
        ids = torch.tensor([p + r])
        logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0]
        lp = torch.log_softmax(logits[len(p) - 1 : -1].double() / temperature, -1)
        lp = lp.gather(1, torch.tensor(r)[:, None])[:, 0]
        total = total + (lp * weights[b, : len(r)]).sum()
        out[b, : len(r)] = lp.detach()
    total.backward()
    return out, {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}


def _packed(model, prompts, responses, temperature, weights):
    model.set_attn_implementation("dualkv")
    model.zero_grad(set_to_none=True)
    pk = dualkv.pack(prompts=prompts, responses=responses)
    lp = dkt.packed_response_logprobs(model, pk, temperature=temperature)
    (lp.double() * weights).sum().backward()
    grads = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
    return lp.detach().double(), grads


def check_against_rows(
    model, seed: int, temperature: float = 1.0, impl: str = "sdpa", low: int = 0, layouts=None
) -> None:
    """The packed log-probs and gradients equal the rows run alone, on every layout (``layouts``,
    else :func:`_layouts`)."""
    for prompts, responses in layouts or _layouts(seed, low):
        g = torch.Generator().manual_seed(seed)
        rmax = max(len(r) for rs in responses for r in rs)
        weights = torch.randn(sum(map(len, responses)), rmax, generator=g, dtype=torch.float64)
        lp_r, g_r = _rows_oracle(model, prompts, responses, temperature, weights, impl)
        lp_p, g_p = _packed(model, prompts, responses, temperature, weights)
        assert lp_r.min() < -1.0  # (the logits are not flat)
        torch.testing.assert_close(lp_p, lp_r, rtol=0, atol=ATOL)
        assert g_p.keys() == g_r.keys() and len(g_r) > 10
        top = max(gr.abs().max().item() for gr in g_r.values())
        for name, gr in g_r.items():
            err = (g_p[name] - gr).abs().max().item()
            assert err <= ATOL * gr.abs().max().item() + 1e-9 * top, (name, err)


def _gemma4(family: str = "gemma4", layer_types: list[str] | None = None, **kw: object):
    """gemma4_config with another layer pattern (and the per-layer head dims recomputed)."""
    if layer_types is None:
        return gemma4_config(family, **kw)
    from transformers import Gemma4TextConfig

    d = gemma4_config(family, **kw).to_dict()
    for k in ("per_layer_config", "transformers_version", "model_type", "architectures"):
        d.pop(k, None)
    d.update(layer_types=layer_types, num_hidden_layers=len(layer_types))
    d.update(global_head_dim=kw.get("global_head_dim") or 2 * int(kw.get("head_dim", 16)))
    d.update(num_global_key_value_heads=kw.get("global_kv_heads", 1))
    return Gemma4TextConfig(**d)


# window: 1 (each token alone), 2, 7 (inside the longer prompts and rows), beyond every row
@pytest.mark.parametrize("window", [1, 2, 7, 40])
def test_gemma4_windows(seed, window):
    config = gemma4_config("gemma4-keqv", window=window)
    check_against_rows(tiny_model("gemma4", torch.float64, seed % 1000, config=config), seed)


def test_gemma4_windows_on_the_boundaries(seed):
    """A prompt of 9 and responses of 6, 1 and 3 tokens (a group of one with 6 after it): windows
    ending just before, on and after the prompt's end and the longest row's end."""
    rng = random.Random(seed)
    layout = (
        [rng.sample(range(VOCAB), 9), rng.sample(range(VOCAB), 3)],
        [[rng.sample(range(VOCAB), n) for n in (6, 1, 3)], [rng.sample(range(VOCAB), 6)]],
    )
    for window in (8, 9, 10, 15, 16):
        config = gemma4_config("gemma4-shared", window=window)
        model = tiny_model("gemma4", torch.float64, seed % 1000, config=config)
        check_against_rows(model, seed, 1.3, layouts=[layout])


@pytest.mark.parametrize(
    "layers",
    [[F, S, S, F], [F], [F, F, F], [S, S, S, F], [F, S, F, S, F]],
    ids=lambda t: "".join(x[0] for x in t),
)
def test_gemma4_layer_patterns(seed, layers):
    config = _gemma4("gemma4", layers, window=3)
    check_against_rows(tiny_model("gemma4", torch.float64, seed % 1000, config=config), seed)


# shared-KV layers read the last earlier non-shared layer of their own type
@pytest.mark.parametrize(
    "layers,shared,k_eq_v",
    [([S, F, S, F, S, F], 2, False), ([S, F, S, F, S, F], 4, True), ([F, S, F, F], 1, False),
     ([F, S, S, F, S, F], 3, True), ([S, S, F, S, F], 2, True), ([F, S, S, F], 2, False)],
    ids=lambda x: "".join(t[0] for t in x) if isinstance(x, list) else str(x),
)  # fmt: skip
def test_gemma4_shared_kv_sources(seed, layers, shared, k_eq_v):
    config = _gemma4("gemma4-keqv" if k_eq_v else "gemma4", layers, window=3,
                     num_kv_shared_layers=shared)  # fmt: skip
    model = tiny_model("gemma4", torch.float64, seed % 1000, config=config)
    assert sum(a.self_attn.is_kv_shared_layer for a in model.model.layers) == shared
    check_against_rows(model, seed)


@pytest.mark.parametrize(
    "global_head_dim,global_kv_heads,k_eq_v",
    [(16, 1, True), (64, 2, True), (8, 4, True), (32, None, True), (32, 1, False)],
)
def test_gemma4_full_layer_heads(seed, global_head_dim, global_kv_heads, k_eq_v):
    config = gemma4_config("gemma4-keqv" if k_eq_v else "gemma4", global_head_dim=global_head_dim,
                           global_kv_heads=global_kv_heads)  # fmt: skip
    check_against_rows(tiny_model("gemma4", torch.float64, seed % 1000, config=config), seed)


_ROPES = {
    "proportional-0.5": {S: {"rope_type": "default", "rope_theta": 100.0},
                         F: {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                             "rope_theta": 1000.0}},
    "default-both": {S: {"rope_type": "default", "rope_theta": 10.0},
                     F: {"rope_type": "default", "rope_theta": 10.0}},
    "linear-sliding": {S: {"rope_type": "linear", "factor": 4.0, "rope_theta": 100.0},
                       F: {"rope_type": "proportional", "partial_rotary_factor": 1.0,
                           "rope_theta": 100.0}},
    "yarn-full": {S: {"rope_type": "default", "rope_theta": 100.0},
                  F: {"rope_type": "yarn", "factor": 4.0, "rope_theta": 100.0,
                      "original_max_position_embeddings": 16}},
    "llama3-full": {S: {"rope_type": "default", "rope_theta": 100.0},
                    F: {"rope_type": "llama3", "factor": 4.0, "rope_theta": 100.0,
                        "original_max_position_embeddings": 16, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0}},
}  # fmt: skip


@pytest.mark.parametrize("rope", list(_ROPES))
def test_gemma4_rope_per_layer_type(seed, rope):
    config = gemma4_config("gemma4", rope_parameters=_ROPES[rope])
    check_against_rows(tiny_model("gemma4", torch.float64, seed % 1000, config=config), seed)


def test_gemma4_other_options(seed):
    """Per-layer input embeddings without shared layers; no final softcap with a temperature;
    an untied LM head; MQA sliding layers; attention biases."""
    for overrides, temperature in (
        (dict(hidden_size_per_layer_input=4, vocab_size_per_layer_input=VOCAB), 1.0),
        (dict(final_logit_softcapping=None), 1.7),
        (dict(tie_word_embeddings=False), 0.6),
        (dict(kv_heads=1, attention_bias=True), 1.0),
    ):
        d = gemma4_config("gemma4").to_dict()
        for k in ("per_layer_config", "transformers_version", "model_type", "architectures"):
            d.pop(k, None)
        kv = overrides.pop("kv_heads", None)
        d.update(overrides, global_head_dim=32, num_global_key_value_heads=1)
        if kv:
            d.update(num_key_value_heads=kv)
        from transformers import Gemma4TextConfig

        model = tiny_model("gemma4", torch.float64, seed % 1000, config=Gemma4TextConfig(**d))
        check_against_rows(model, seed, temperature)


def _edit(config, **changes):
    d = config.to_dict()
    for k in ("transformers_version", "model_type", "architectures"):
        d.pop(k, None)
    d.update(changes)
    return type(config)(**d)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"sliding_window": 1},
        {"sliding_window": 2},
        {"query_pre_attn_scalar": 7},
        {"layer_types": [F, S, S, F], "num_hidden_layers": 4},
        {
            "rope_parameters": {
                F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                S: {"rope_type": "default", "rope_theta": 1e4},
            }
        },
    ],
    ids=["base", "window1", "window2", "qpas7", "FSSF", "linear-rope"],
)
def test_gemma3(seed, changes):
    config = _edit(tiny_config("gemma3"), **changes)
    check_against_rows(tiny_model("gemma3", torch.float64, seed % 1000, config=config), seed, 0.8)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"sliding_window": 1},
        {"attn_logit_softcapping": 0.5},
        {"query_pre_attn_scalar": 3},
        {"layer_types": [S, S, S, F], "num_hidden_layers": 4},
    ],
    ids=["base", "window1", "softcap0.5", "qpas3", "SSSF"],
)
def test_gemma2(seed, changes):
    config = _edit(tiny_config("gemma2"), **changes)
    model = tiny_model("gemma2", torch.float64, seed % 1000, config=config)
    check_against_rows(model, seed, 0.8, impl="eager")  # (SDPA cannot soft-cap)


def test_gemma3n(seed):
    """Gemma 3n text: AltUp, LAuReL, per-layer inputs, shared KV, activation sparsity."""
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    config = Gemma3nTextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
        layer_types=[S, F, S, F, S, F], final_logit_softcapping=10.0,
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
        num_kv_shared_layers=2, laurel_rank=4, max_position_embeddings=512,
        activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0, 0.0, 0.0],
    )  # fmt: skip
    torch.manual_seed(seed % 1000)
    model = Gemma3nForCausalLM(config).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15 if "embed" in name else 0.08)
    check_against_rows(model, seed, 0.9)


def _gemma3_multimodal(seed: int, final_logit_softcapping: float | None):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = _edit(tiny_config("gemma3"), final_logit_softcapping=final_logit_softcapping)
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(seed % 1000)
    model = Gemma3ForConditionalGeneration(config).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5 if "embed" in name else 0.08)
    return model


@pytest.mark.parametrize("final_logit_softcapping", [None, 15.0])
def test_gemma3_multimodal_class_without_final_softcap(seed, final_logit_softcapping):
    """Gemma3ForConditionalGeneration never applies its text config's final_logit_softcapping
    (only Gemma3ForCausalLM does): the packed head soft-capped anyway, log-probs 18.8 off the
    model's own rows (gradients 88% off) with a cap of 15. The packed head follows the class."""
    model = _gemma3_multimodal(seed, final_logit_softcapping)
    check_against_rows(model, seed)
    assert dkt.lm_head_softcap(model) is None
    assert dkt.lm_head_softcap(torch.compile(model)) is None  # (the wrapper is looked through)
    causal = tiny_model("gemma3", torch.float64, seed % 1000)
    assert dkt.lm_head_softcap(causal) == causal.config.final_logit_softcapping == 15.0
    assert dkt.lm_head_softcap(torch.compile(causal)) == 15.0


def test_gemma4_multimodal_class_refuses_media_placeholder_tokens(seed):
    """Gemma4ForConditionalGeneration's forward gives its image / video / audio placeholder
    tokens the pad token's embedding and per-layer inputs when no media come with them, while
    the packed forward runs the text decoder, which embeds them as text: a prompt with image
    tokens (or a sampled response with an audio token) was scored silently off the model's own
    rows (log-probs 0.98 / 1.57 apart). Such a batch raises; a batch without them packs; TRL's
    packed forward, which runs the multimodal base model, takes them."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = gemma4_config("gemma4-ple")
    config = Gemma4Config(
        text_config=text.to_dict(), vision_config=None, audio_config=None,
        image_token_id=7, video_token_id=8, audio_token_id=9, boi_token_id=10, eoi_token_id=11,
    )  # fmt: skip
    torch.manual_seed(seed % 1000)
    model = Gemma4ForConditionalGeneration(config).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15 if "embed" in name else 0.08)
    model.set_attn_implementation("dualkv")
    rng = random.Random(seed)
    text_ids = list(range(12, VOCAB))
    for prompt, responses in (
        (
            [*rng.sample(text_ids, 3), 10, 7, 7, 11, *rng.sample(text_ids, 2)],
            [rng.sample(text_ids, 3)],
        ),
        (rng.sample(text_ids, 5), [rng.sample(text_ids, 2), [rng.choice(text_ids), 9]]),
        (rng.sample(text_ids, 5), [[8], rng.sample(text_ids, 2)]),
    ):
        pk = dualkv.pack(prompts=[prompt], responses=[responses])
        with pytest.raises(NotImplementedError, match="placeholder tokens"):
            dkt.packed_response_logprobs(model, pk)
    check_against_rows(model, seed, low=12)
    # TRL's packed forward runs the multimodal base model (Gemma4Model), which embeds them as
    # the model does: not refused, and equal to the rows
    pytest.importorskip("trl")
    from dualkv.integrations.trl import add_packed_lm_head

    weights = torch.zeros(pk.response_mask.shape, dtype=torch.float64)
    want, _ = _rows_oracle(model, [prompt], [responses], 1.0, weights, "sdpa")
    model.set_attn_implementation("dualkv")
    add_packed_lm_head(model)
    with torch.no_grad():
        got = model(dualkv_packed=pk).log_probs
    torch.testing.assert_close(got.double(), want, rtol=0, atol=ATOL)


def test_gemma3_bidirectional_text_is_refused_by_name(seed):
    """Gemma 3 with use_bidirectional_attention=True attends over the whole text both ways: the
    packed forward refuses it, and the message names that option (not only media tokens)."""
    config = _edit(tiny_config("gemma3"), use_bidirectional_attention=True)
    model = tiny_model("gemma3", torch.float64, seed % 1000, config=config)
    with pytest.raises(ValueError, match="use_bidirectional_attention=True"):
        _packed(model, [[3, 4, 5]], [[[6, 7], [8]]], 1.0, torch.ones(2, 2, dtype=torch.float64))
