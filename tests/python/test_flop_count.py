"""The FLOP count behind every TF/s and MFU figure (bench/RESULTS.md), against oracles written
from DESIGN.md's words alone: a token-level enumeration of allowed (query, key) pairs, the pairs
the CPU kernel really attends to (forward and backward), and a hand count of a model step's
useful FLOPs (bench/model_step.py's MFU numerator)."""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

import dualkv

Token = tuple[int, int, int]  # (group, segment: -1 prompt / i response i, logical position)


def tokens(prefix: list[int], resp: list[list[int]]) -> list[Token]:
    out: list[Token] = []
    for g, (p, rs) in enumerate(zip(prefix, resp, strict=True)):
        out += [(g, -1, j) for j in range(p)]
        for i, r in enumerate(rs):
            out += [(g, i, p + j) for j in range(r)]
    return out


def sees(q: Token, k: Token, window: int | None) -> bool:
    """DESIGN.md's rule, clause by clause (the window counts the query itself: w tokens)."""
    (gq, sq, pq), (gk, sk, pk) = q, k
    if gq != gk:
        return False
    if sk == -1:  # key in the prompt: causal for a prompt query, all of it for a response query
        ok = pk <= pq if sq == -1 else True
    else:  # key in a response: only the same response's queries, causally
        ok = sk == sq and pk <= pq
    return ok and (window is None or pq - pk < window)


def rows_pairs(prefix: list[int], resp: list[list[int]], window: int | None) -> int:
    """Pairs of plain causal attention over the N unshared rows [prompt | r_i]."""
    return sum(
        1
        for p, rs in zip(prefix, resp, strict=True)
        for r in rs
        for q in range(p + r)
        for k in range(q + 1)
        if window is None or q - k < window
    )


def random_layout(rng: random.Random) -> tuple[list[int], list[list[int]]]:
    """1-4 groups; P, N and R of 0 and 1 often, uneven R."""
    prefix, resp = [], []
    for _ in range(rng.choice([1, 1, 2, 3, 4])):
        prefix.append(rng.choice([0, 1, 2, rng.randint(0, 24)]))
        n = rng.choice([0, 1, 2, rng.randint(0, 5)])
        resp.append([rng.choice([0, 1, rng.randint(0, 16)]) for _ in range(n)])
    return prefix, resp


def random_window(rng: random.Random, t: int) -> int | None:
    """No window, 1-3, inside the stream, equal to it, beyond it, int32's 'no window'."""
    return rng.choice([None, 1, 2, 3, rng.randint(1, max(1, t)), max(1, t), t + 1, 2**31 - 1])


def test_pairs_and_flops_match_the_token_rule(seed: int) -> None:
    """allowed_pairs / flops against every (q, k) of the packed stream checked by the rule, and
    the packed count's relation to the N-rows count: rows = packed + (N - 1) x prompt's causal
    pairs per group (the prompt once instead of N times; a group with N = 0 has no row)."""
    rng = random.Random(seed)
    for _ in range(150):
        prefix, resp = random_layout(rng)
        layout = dualkv.Layout(prefix, resp)
        toks = tokens(prefix, resp)
        w = random_window(rng, len(toks))
        pairs = sum(sees(q, k, w) for q in toks for k in toks)
        assert layout.allowed_pairs(w) == pairs, (prefix, resp, w)
        d, hq = rng.choice([64, 128, 256, 512]), rng.choice([1, 8, 32])
        assert layout.flops(d, hq, w) == 4 * d * hq * pairs
        assert layout.flops(d, hq, w, backward=True) == 2.5 * 4 * d * hq * pairs
        prompt = [rows_pairs([p], [[0]], w) for p in prefix]  # a prompt's causal pairs
        shared = sum((len(rs) - 1) * x for x, rs in zip(prompt, resp, strict=True) if rs)
        alone = sum(x for x, rs in zip(prompt, resp, strict=True) if not rs)
        assert rows_pairs(prefix, resp, w) == pairs + shared - alone, (prefix, resp, w)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kernel_attends_exactly_the_counted_pairs(dtype: torch.dtype, seed: int) -> None:
    """With q = 0 every visible key gets weight 1/n > 0 and every other key exactly 0; with v and
    dout one-hot per token, out[q] and dv.T show the forward's and the backward's visible sets,
    which must be the rule's pairs, as many as the FLOP count credits."""
    rng = random.Random(seed)
    checked = 0
    while checked < 40:
        prefix, resp = random_layout(rng)
        toks = tokens(prefix, resp)
        t = len(toks)
        if t == 0:
            continue
        w = random_window(rng, t)
        layout = dualkv.Layout(prefix, resp)
        q = torch.zeros(t, 2, t, dtype=dtype, requires_grad=True)
        k = torch.randn(t, 1, t, dtype=dtype, requires_grad=True)
        v = torch.eye(t, dtype=dtype)[:, None, :].clone().requires_grad_()
        out = dualkv.attention(q, k, v, layout, window=w)
        assert isinstance(out, torch.Tensor)
        want = torch.tensor([[sees(a, b, w) for b in toks] for a in toks])
        assert torch.equal(out[:, 0] > 0, want) and torch.equal(out[:, 1] > 0, want)
        out.backward(torch.eye(t, dtype=dtype)[:, None, :].expand(t, 2, t))
        assert v.grad is not None
        assert torch.equal(v.grad[:, 0].T > 0, want), (prefix, resp, w)
        assert int(want.sum()) == layout.allowed_pairs(w)
        checked += 1


@pytest.fixture(scope="module")
def model_step():  # noqa: ANN201
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    import model_step as ms

    return ms


@pytest.mark.parametrize("preset", ["tiny", "gemma4-tiny"])
def test_model_step_useful_flops(preset: str, model_step) -> None:  # noqa: ANN001
    """bench/model_step.py's MFU numerator: 6 x (decoder weights) x packed tokens + 6 x hidden x
    vocab x scored tokens (N x R; the embedding lookup is free) + 3.5 x each layer's attention
    forward count with that layer's head dim and window; checkpoint recompute not counted."""
    from dualkv.demos.grpo_step import PRESETS

    model = model_step.build_any(preset, torch.device("cpu"), torch.float32)
    c = model.config  # the preset's fields (Gemma 4's config refuses per-layer reads like head_dim)
    f = dict(model_step.GEMMA4_PRESETS.get(preset) or PRESETS[preset])
    h, hq = f["hidden_size"], f["num_attention_heads"]
    kinds = getattr(c, "layer_types", None) or ["full_attention"] * f["num_hidden_layers"]
    assert len(kinds) == f["num_hidden_layers"]
    for n, p, r in [(4, 64, 16), (3, 5, 40), (1, 1, 1), (16, 8192, 1024)]:
        layout = dualkv.Layout([p], [[r] * n])
        t = p + n * r
        want = 6.0 * n * r * h * f["vocab_size"]
        for kind in kinds:
            hd, hkv, window = f["head_dim"], f["num_key_value_heads"], None
            kv_mats = 2
            if kind == "sliding_attention":
                window = f["sliding_window"]
            elif preset.startswith("gemma4"):  # global layers: own head dim / KV heads, k = v
                hd, hkv = f["global_head_dim"], f["num_global_key_value_heads"]
                kv_mats = 1 if f["attention_k_eq_v"] else 2
            weights = 2 * h * hq * hd + kv_mats * h * hkv * hd + 3 * h * f["intermediate_size"]
            want += 6.0 * t * weights
            visible = sum(min(pos + 1, window or pos + 1) for pos in range(p))
            visible += n * sum(min(pos + 1, window or pos + 1) for pos in range(p, p + r))
            want += 3.5 * 4 * hd * hq * visible
        assert model_step.useful_flops(model, layout, n * r) == pytest.approx(want, rel=1e-12)
