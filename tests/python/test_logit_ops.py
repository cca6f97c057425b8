"""dualkv::logit_stats / dualkv::logit_grad_ (include/dualkv/logits.h) on CPU and CUDA against a
float64 autograd reference on the same (rounded) logits; edge cases and errors."""

from __future__ import annotations

import pytest
import torch

import dualkv  # noqa: F401  (loads the op library)
from dualkv._ops import ops
from dualkv.logprobs import logprobs_from_logits, response_logprobs
from dualkv.packing import pack

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def reference(z, labels, temperature, softcap, g_logp, g_ent):
    """float64 logp, lse, entropy and dL/dz by autograd."""
    z64 = z.detach().double().requires_grad_()
    x = softcap * torch.tanh(z64 / softcap) if softcap else z64
    x = x / temperature
    logp_all = torch.log_softmax(x, dim=-1)
    lse = torch.logsumexp(x, dim=-1)
    logp = logp_all.gather(1, labels[:, None]).squeeze(1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    loss = (logp * g_logp.double()).sum()
    if g_ent is not None:
        loss = loss + (ent * g_ent.double()).sum()
    loss.backward()
    return logp.detach(), lse.detach(), ent.detach(), z64.grad


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(stats tolerance, gradient rtol): accumulation precision, then one rounding to dtype."""
    if dtype == torch.float64:
        return 1e-12, 1e-12
    return 2e-5, {torch.float32: 2e-6, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]


def make(rows, vocab, dtype, device, seed, stride=None):
    gen = torch.Generator().manual_seed(seed)
    width = stride or vocab
    z = (torch.randn(rows, width, generator=gen) * 3).to(dtype).to(device)[:, :vocab]
    labels = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    g = torch.randn(rows, generator=gen, dtype=acc).to(device)
    ge = torch.randn(rows, generator=gen, dtype=acc).to(device)
    return z, labels, g, ge


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "vocab,temperature,softcap,entropy",
    [(1, 1.0, 0.0, False), (7, 0.7, 0.0, True), (1000, 1.0, 0.0, False), (4099, 1.3, 30.0, True)],
)
def test_logit_ops_match_reference(device, dtype, vocab, temperature, softcap, entropy, seed):
    rows = 37
    z, labels, g, ge = make(rows, vocab, dtype, device, seed)
    ref_lp, ref_lse, ref_ent, ref_grad = reference(
        z, labels, temperature, softcap, g, ge if entropy else None
    )
    tol, rtol = tolerances(dtype)
    lp, lse, ent = ops.logit_stats(z, labels, temperature, softcap, entropy)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert lp.dtype == acc and lse.dtype == acc and ent.shape == (rows if entropy else 0,)
    torch.testing.assert_close(lp.double().cpu(), ref_lp.cpu(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double().cpu(), ref_lse.cpu(), rtol=tol, atol=tol)
    if entropy:
        torch.testing.assert_close(ent.double().cpu(), ref_ent.cpu(), rtol=tol, atol=tol)
    gz = z.clone()
    ops.logit_grad_(
        gz, labels, lse, g, ge if entropy else None, ent if entropy else None, temperature, softcap
    )
    assert gz.dtype == dtype
    torch.testing.assert_close(gz.double().cpu(), ref_grad.cpu(), rtol=rtol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_logit_ops_strided_rows(device, seed):
    """Rows with a stride that is not a multiple of 16 bytes (the CUDA kernels' scalar path)."""
    z, labels, g, _ = make(9, 301, torch.bfloat16, device, seed, stride=305)
    assert z.stride(0) == 305 and not z.is_contiguous()
    lp, lse, _ = ops.logit_stats(z, labels, 1.0, 0.0, False)
    ref_lp, ref_lse, _, ref_grad = reference(z, labels, 1.0, 0.0, g, None)
    torch.testing.assert_close(lp.double().cpu(), ref_lp.cpu(), rtol=2e-5, atol=2e-5)
    ops.logit_grad_(z, labels, lse, g, None, None, 1.0, 0.0)  # in place, into the strided view
    torch.testing.assert_close(z.double().cpu(), ref_grad.cpu(), rtol=2**-8, atol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_logit_ops_inf_and_nan(device):
    z = torch.randn(3, 50, device=device)
    z[0, 5:20] = float("-inf")  # masked vocabulary entries: probability 0, gradient 0
    z[1, 7] = float("nan")
    labels = torch.tensor([2, 3, 4], device=device)
    lp, lse, ent = ops.logit_stats(z, labels, 1.0, 0.0, True)
    ref = torch.log_softmax(z[0].double(), -1)
    torch.testing.assert_close(lp[0].double(), ref[2], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(ent[0]) and torch.isnan(lp[1]) and torch.isnan(lse[1])
    g = torch.ones(3, device=device)
    gz = z.clone()
    ops.logit_grad_(gz, labels, lse, g, g, ent, 1.0, 0.0)
    assert (gz[0, 5:20] == 0).all() and torch.isfinite(gz[0]).all()
    assert torch.isnan(gz[1]).all()


def test_logit_ops_errors():
    z = torch.randn(4, 10)
    labels = torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ops.logit_stats(z, torch.tensor([0, 1, 10, 3]), 1.0, 0.0, False)
    with pytest.raises(ValueError, match="rows"):
        ops.logit_stats(z, labels[:3], 1.0, 0.0, False)
    with pytest.raises(ValueError, match="logits must be"):
        ops.logit_stats(z[0], labels, 1.0, 0.0, False)
    with pytest.raises(ValueError, match="temperature"):
        ops.logit_stats(z, labels, 0.0, 0.0, False)
    with pytest.raises(ValueError, match="softcap"):
        ops.logit_stats(z, labels, 1.0, -1.0, False)
    # float32 accumulation: values float rounds to 0 / inf are refused (a dropped softcap or NaN
    # log-probs otherwise); float64 logits accumulate in double and take them
    for temp, cap, what in [(1e-46, 0.0, "temperature"), (1e39, 0.0, "temperature"),
                            (1.0, 1e-46, "softcap"), (1.0, 1e39, "softcap")]:  # fmt: skip
        for zz in (z, z.bfloat16()):
            with pytest.raises(ValueError, match=f"{what}=.*outside float32's range"):
                ops.logit_stats(zz, labels, temp, cap, False)
        with pytest.raises(ValueError, match=f"{what}=.*outside float32's range"):
            ops.logit_grad_(z.clone(), labels, torch.zeros(4), torch.ones(4), None, None, temp, cap)
        lp64, _, _ = ops.logit_stats(z.double(), labels, temp, cap, False)
        assert not torch.isnan(lp64).any()
    with pytest.raises(TypeError, match="integer"):
        ops.logit_stats(z, labels.float(), 1.0, 0.0, False)
    with pytest.raises(TypeError, match="logits has dtype"):
        ops.logit_stats(z.int(), labels, 1.0, 0.0, False)
    lp, lse, _ = ops.logit_stats(z, labels, 1.0, 0.0, False)
    with pytest.raises(ValueError, match="unit column stride"):
        ops.logit_grad_(z.t().contiguous().t(), labels, lse, lp, None, None, 1.0, 0.0)
    with pytest.raises(ValueError, match="entropy"):
        ops.logit_grad_(z.clone(), labels, lse, lp, lp, None, 1.0, 0.0)


@pytest.mark.gpu
def test_logit_ops_cuda_label_out_of_range_is_nan_and_bitwise_repeatable(seed):
    z, labels, g, ge = make(64, 3001, torch.bfloat16, "cuda", seed)
    bad = labels.clone()
    bad[5] = 3001
    lp, _, _ = ops.logit_stats(z, bad, 1.0, 0.0, False)
    assert torch.isnan(lp[5]) and torch.isfinite(lp[torch.arange(64, device="cuda") != 5]).all()
    first = ops.logit_stats(z, labels, 0.9, 0.0, True)
    gz0 = z.clone()
    ops.logit_grad_(gz0, labels, first[1], g, ge, first[2], 0.9, 0.0)
    for _ in range(10):
        again = ops.logit_stats(z, labels, 0.9, 0.0, True)
        assert all(torch.equal(a, b) for a, b in zip(again, first, strict=True))
        gz = z.clone()
        ops.logit_grad_(gz, labels, again[1], g, ge, again[2], 0.9, 0.0)
        assert torch.equal(gz, gz0)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.8, 20.0)])
def test_response_logprobs_cuda_bf16_tolerance(temperature, softcap, seed):
    """On the GPU, bf16: the chunked path's log-probs, entropies and gradients against an fp64
    reference stay within 2x (3x for gradients) the plain bf16 full-logit path's error."""
    torch.manual_seed(seed)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    gen = torch.Generator().manual_seed(seed)
    responses = [
        [torch.randint(0, 3000, (int(n),), generator=gen).tolist() for n in (40, 3, 17)],
        [torch.randint(0, 3000, (int(n),), generator=gen).tolist() for n in (1, 64)],
    ]
    pk = pack(prompts=prompts, responses=responses, device="cuda")
    hidden = torch.randn(pk.total_tokens, 64, device="cuda", dtype=torch.float64)
    weight = torch.randn(3000, 64, device="cuda", dtype=torch.float64) * 0.2
    g_lp = torch.randn(pk.num_rows, pk.max_response_len, device="cuda", dtype=torch.float64)
    g_en = torch.randn_like(g_lp)

    def full(h, w):  # the rows' computation: every response position's logits at once
        h = h.detach().requires_grad_()
        w = w.detach().requires_grad_()
        logits = torch.nn.functional.linear(h.index_select(0, pk.token_sources), w)
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        lp_flat, en_flat = logprobs_from_logits(
            logits, pk.token_labels, temperature=temperature, return_entropy=True
        )
        shape = (pk.num_rows * pk.max_response_len,)
        lp = lp_flat.new_zeros(shape).index_copy(0, pk.token_rows, lp_flat).view_as(g_lp)
        en = en_flat.new_zeros(shape).index_copy(0, pk.token_rows, en_flat).view_as(g_lp)
        ((lp * g_lp).sum() + (en * g_en).sum()).backward()
        return lp.detach(), en.detach(), h.grad, w.grad

    def chunked(h, w):
        h = h.detach().requires_grad_()
        w = w.detach().requires_grad_()
        lp, en = response_logprobs(
            h, w, pk, temperature=temperature, return_entropy=True, logit_softcap=softcap,
            chunk_size=32,
        )  # fmt: skip
        ((lp * g_lp).sum() + (en * g_en).sum()).backward()
        return lp.detach(), en.detach(), h.grad, w.grad

    ref = full(hidden, weight)
    plain = full(hidden.bfloat16(), weight.bfloat16())
    got = chunked(hidden.bfloat16(), weight.bfloat16())
    for i, (r, p, x) in enumerate(zip(ref, plain, got, strict=True)):
        bound = (2 if i < 2 else 3) * (p.double() - r).abs().max().item() + 1e-4
        err = (x.double() - r).abs().max().item()
        assert err <= bound, (i, err, bound)
