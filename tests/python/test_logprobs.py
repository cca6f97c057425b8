"""dualkv.response_logprobs: chunked packed log-probs/entropy equal the rows' full-logit path."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dualkv.logprobs import logprobs_from_logits, response_logprobs
from dualkv.packing import pack, rows_from_lists
from hf_helpers import random_groups


def _rows_reference(hidden, weight, bias, pk, ids, mask, pw, temperature, softcap):
    """Standard path: scatter packed hidden states into rows, full logits, log-softmax."""
    n, width = ids.shape
    rows_h = hidden.new_zeros(n, width, hidden.shape[-1])
    for b in range(n):  # tiny test: build each row [prompt | response] from the packed stream
        g = int(pk.row_group[b])
        start = sum(
            p + sum(r)
            for p, r in zip(pk.layout.prefix_lens[:g], pk.layout.response_lens[:g], strict=True)
        )
        p_len = pk.layout.prefix_lens[g]
        r_len = int(mask[b, pw:].sum())
        rows_h[b, pw - p_len : pw] = hidden[start : start + p_len]
        r0 = int(pk.response_index[b, 0])
        rows_h[b, pw : pw + r_len] = hidden[r0 : r0 + r_len]
    logits = torch.nn.functional.linear(rows_h[:, pw - 1 : -1], weight, bias)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return logprobs_from_logits(logits, ids[:, pw:], mask[:, pw:].bool(), temperature, True)


@pytest.mark.parametrize("temperature,softcap,bias", [(1.0, None, False), (0.7, 5.0, True)])
def test_logprobs_match_rows_fp64(seed, temperature, softcap, bias):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    prompts, responses = random_groups(
        rng, groups=3, p_range=(1, 7), n_range=(1, 4), r_range=(0, 6)
    )
    ids, mask, pw, gid = rows_from_lists(prompts, responses)
    pk = pack(ids, mask, pw, gid)
    hdim, vocab = 12, 131
    hidden = torch.randn(pk.total_tokens, hdim, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hdim, dtype=torch.float64, requires_grad=True)
    b = torch.randn(vocab, dtype=torch.float64, requires_grad=True) if bias else None
    g_lp = torch.randn(ids.shape[0], ids.shape[1] - pw, dtype=torch.float64)
    g_en = torch.randn_like(g_lp)

    ref_lp, ref_en = _rows_reference(hidden, weight, b, pk, ids, mask, pw, temperature, softcap)
    ((ref_lp * g_lp).sum() + (ref_en * g_en).sum()).backward()
    ref_grads = [t.grad.clone() for t in (hidden, weight, b) if t is not None]

    for chunk in (1, 3, None):
        for t in (hidden, weight, b):
            if t is not None:
                t.grad = None
        lp, en = response_logprobs(
            hidden.unsqueeze(0), weight, pk, temperature=temperature, return_entropy=True,
            lm_head_bias=b, logit_softcap=softcap, chunk_size=chunk,
        )  # fmt: skip
        assert lp.shape == ids[:, pw:].shape and lp.dtype == torch.float64
        assert (lp[~pk.response_mask] == 0).all() and (en[~pk.response_mask] == 0).all()
        torch.testing.assert_close(lp, ref_lp, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(en, ref_en, rtol=1e-10, atol=1e-10)
        ((lp * g_lp).sum() + (en * g_en).sum()).backward()
        grads = [t.grad for t in (hidden, weight, b) if t is not None]
        for got, want in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_logprobs_chunking_is_exact_and_grad_only_logprob(seed):
    torch.manual_seed(seed)
    rng = random.Random(seed)
    prompts, responses = random_groups(rng, groups=2, n_range=(2, 5))
    pk = pack(prompts=prompts, responses=responses)
    hidden = torch.randn(1, pk.total_tokens, 16, requires_grad=True)
    weight = torch.randn(131, 16, requires_grad=True)
    outs = []
    for chunk in (1, 5, 10_000):
        hidden.grad = weight.grad = None
        lp = response_logprobs(hidden, weight, pk, chunk_size=chunk)
        (lp * torch.arange(lp.numel()).view_as(lp)).sum().backward()
        outs.append((lp.detach(), hidden.grad.clone(), weight.grad.clone()))
    for o in outs[1:]:
        for a, b in zip(o, outs[0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)
    # weight only (frozen hidden) and hidden only (frozen head): each gradient equals its part
    # of the gradient of both
    hidden.grad = weight.grad = None
    response_logprobs(hidden, weight, pk).sum().backward()
    want_h, want_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    lp = response_logprobs(hidden.detach(), weight, pk)
    assert lp.requires_grad
    lp.sum().backward()
    assert hidden.grad is None
    torch.testing.assert_close(weight.grad, want_w, rtol=1e-5, atol=1e-5)
    weight.grad = None
    lp = response_logprobs(hidden, weight.detach(), pk)
    lp.sum().backward()
    assert weight.grad is None
    torch.testing.assert_close(hidden.grad, want_h, rtol=1e-5, atol=1e-5)
    assert want_h.abs().sum() > 0 and want_w.abs().sum() > 0


def test_logprobs_bf16_tolerance(seed):
    """bf16 packed error vs an fp64 reference stays within 2x the plain bf16 rows' error."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    prompts, responses = random_groups(rng, groups=3, n_range=(2, 4))
    ids, mask, pw, gid = rows_from_lists(prompts, responses)
    pk = pack(ids, mask, pw, gid)
    hidden = torch.randn(pk.total_tokens, 32, dtype=torch.float64)
    weight = torch.randn(200, 32, dtype=torch.float64) * 0.3
    ref, _ = _rows_reference(hidden, weight, None, pk, ids, mask, pw, 1.0, None)
    lo, _ = _rows_reference(
        hidden.bfloat16(), weight.bfloat16(), None, pk, ids, mask, pw, 1.0, None
    )
    got = response_logprobs(hidden.bfloat16(), weight.bfloat16(), pk, chunk_size=4)
    err_rows = (lo.double() - ref).abs().max().item()
    err_packed = (got.double() - ref).abs().max().item()
    assert err_packed <= 2 * err_rows + 1e-3, (err_packed, err_rows)


def test_logprobs_errors():
    pk = pack(prompts=[[1, 2]], responses=[[[3], [4, 5]]])
    h = torch.randn(pk.total_tokens, 8)
    w = torch.randn(10, 8)
    with pytest.raises(ValueError, match="packed tokens"):
        response_logprobs(h[1:], w, pk)
    with pytest.raises(ValueError, match="lm_head_weight"):
        response_logprobs(h, w[:, 1:], pk)
    for temp in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            response_logprobs(h, w, pk, temperature=temp)
        with pytest.raises(ValueError, match="temperature"):
            logprobs_from_logits(torch.randn(2, 10), torch.tensor([1, 2]), temperature=temp)
    with pytest.raises(ValueError, match="chunk_size"):
        response_logprobs(h, w, pk, chunk_size=0)


def test_rows_reference_with_minus_inf_logits_and_masked_nan(seed):
    """logprobs_from_logits (the rows' yardstick): a -inf logit (a banned token) has p log p = 0,
    as the chunked op has it, not NaN; a non-finite row at a masked position gives 0, not NaN."""
    torch.manual_seed(seed)
    pk = pack(prompts=[[1, 2, 3]], responses=[[[4, 5, 6], [7]]])
    h, w = torch.randn(pk.total_tokens, 8), torch.randn(12, 8)
    bias = torch.zeros(12)
    bias[[0, 9]] = -math.inf
    lp, ent = response_logprobs(h, w, pk, lm_head_bias=bias, return_entropy=True)
    logits = torch.nn.functional.linear(h, w, bias)[pk.token_sources]
    lp_r, ent_r = logprobs_from_logits(logits, pk.token_labels, return_entropy=True)
    assert torch.isfinite(ent_r).all()
    torch.testing.assert_close(pk.scatter_tokens(ent_r), ent)
    torch.testing.assert_close(pk.scatter_tokens(lp_r), lp)
    rows = torch.randn(2, 3, 12)
    rows[1, 2] = math.nan
    mask = torch.tensor([[True, True, True], [True, True, False]])
    lp_m, ent_m = logprobs_from_logits(rows, torch.ones(2, 3, dtype=torch.long), mask, 1.0, True)
    assert lp_m[1, 2] == 0 and ent_m[1, 2] == 0 and torch.isfinite(lp_m).all()


def test_logprobs_save_no_vocab_sized_tensor(seed):
    """Nothing of [tokens x vocab] is kept for backward: the logits are recomputed per chunk."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    prompts, responses = random_groups(rng, groups=2, n_range=(3, 4), r_range=(8, 12))
    pk = pack(prompts=prompts, responses=responses)
    vocab = 1000
    hidden = torch.randn(pk.total_tokens, 8, requires_grad=True)
    weight = torch.randn(vocab, 8, requires_grad=True)
    saved = []

    def keep(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        lp, en = response_logprobs(hidden, weight, pk, return_entropy=True, chunk_size=4)
        (lp.sum() + en.sum()).backward()
    assert saved and max(saved) <= vocab * 8  # the weight itself is the largest saved tensor


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_logprobs_gradient_under_autocast(seed, device):
    """float32 model under torch.autocast(bf16), the backward after the autocast block (how
    trainers run it): the gradient is that of the bf16 logits the forward used. The op's backward
    recomputed the logits in float32 against the bf16 forward's lse before, so the softmax it
    differentiated did not sum to 1 (the bias gradient summed to ~0.1 instead of 0, and a
    confident token's gradient changed sign). On cuda: the CUDA log-prob kernels."""
    torch.manual_seed(seed)
    vocab, h = 4096, 64
    pk = pack(prompts=[[1, 2, 3], [4]], responses=[[[5, 6, 7], [8]], [[9, 10]]], device=device)
    hidden = torch.randn(pk.total_tokens, h, device=device)
    weight = torch.randn(vocab, h, device=device) * (8 / h**0.5)  # logits of std ~8
    grads = {}
    for path in ("dualkv", "rows"):
        hd = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        b = torch.zeros(vocab, device=device, requires_grad=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            if path == "dualkv":
                lp = response_logprobs(hd, w, pk, lm_head_bias=b)[pk.response_mask]
            else:  # the rows' LM head under the same autocast, log-softmax in float32
                z = torch.nn.functional.linear(hd[pk.token_sources], w, b).float()
                lp = torch.log_softmax(z, -1).gather(-1, pk.token_labels[:, None])[:, 0]
        lp.sum().backward()
        # sum_v d logp / d z_v = 0 up to bf16 rounding (the rows path: 2e-3 to 5e-3; before the
        # fix DualKV's was 0.06 to 0.31 over these 6 tokens)
        assert abs(b.grad.sum().item()) < 0.02, (path, b.grad.sum().item())
        grads[path] = (hd.grad, w.grad, b.grad)
    for got, want in zip(grads["dualkv"], grads["rows"], strict=True):
        assert (got - want).norm() <= 1e-2 * want.norm(), ((got - want).norm(), want.norm())


def test_logprobs_float64_under_autocast(seed):
    """autocast never casts float64: a float64 model under a trainer's bf16 autocast scores in
    float64, as the rows' LM head (F.linear under the same autocast) does; the LM head was cast to
    bf16 before (the HF backend's q/k/v too, and the model then crashed: 'expected m1 and m2 to
    have the same dtype')."""
    torch.manual_seed(seed)
    vocab, h = 50, 16
    pk = pack(prompts=[[1, 2, 3], [4]], responses=[[[5, 6, 7], [8]], [[9, 10]]])
    hidden = torch.randn(pk.total_tokens, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, h, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(vocab, dtype=torch.float64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = response_logprobs(hidden, weight, pk, lm_head_bias=bias)[pk.response_mask]
        z = torch.nn.functional.linear(hidden[pk.token_sources], weight, bias)
    assert z.dtype == lp.dtype == torch.float64
    want = torch.log_softmax(z, -1).gather(-1, pk.token_labels[:, None])[:, 0]
    torch.testing.assert_close(lp, want, rtol=0, atol=1e-12)
    got = torch.autograd.grad(lp.sum(), (hidden, weight, bias))
    for a, b in zip(got, torch.autograd.grad(want.sum(), (hidden, weight, bias)), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_rows_reference_gradient_with_masked_nonfinite_logits(bad):
    """A masked (padding) row of non-finite logits stays out of the gradient too, not only of
    the values (log_softmax's backward made the whole row NaN before)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 11)
    logits[1, 2] = bad
    logits.requires_grad_(True)
    labels = torch.randint(0, 11, (2, 4))
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1, 2] = False
    logp, ent = logprobs_from_logits(logits, labels, mask, return_entropy=True)
    (logp.sum() + ent.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[1, 2] == 0).all()
