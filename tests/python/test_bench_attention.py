"""bench/attention.py's baselines, on CPU: the 3-pass + lse-merge composition (run with a plain
PyTorch kernel in each of the two tensor layouts its GPU kernels use), the rows methods' gradients
mapped back to the packed layout, the correctness check (it passes DualKV, fails a wrong method,
skips a missing package or head dim with the reason) and the command line. The oracle is
dualkv.reference's unshared rows in float64."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from dualkv.reference import unshared_attention

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import attention as ba  # noqa: E402


def math_attention(q, k, v, scale, causal):
    """[B, Lq, Hq, D] x [B, Lk, Hkv, D] -> out [B, Lq, Hq, D], lse [B, Hq, Lq] (causal: Lq = Lk)."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), v), lse


def math_attention_backward(dout, q, k, v, out, lse, scale, causal):
    """FlashAttention's backward from the given out and lse (not recomputed ones), so that a
    composition feeding a pass anything but the merged out/lse gets wrong gradients."""
    g = q.shape[2] // k.shape[2]
    ke, ve = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, ke) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(s - lse[..., None])
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, ve)
    delta = (dout * out).sum(-1).transpose(1, 2)  # [B, H, Lq]
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, ke) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
    heads = lambda x: x.unflatten(2, (k.shape[2], g)).sum(3)  # noqa: E731
    return dq, heads(dk), heads(dv)


class MathFlash(ba.PassKernel):
    """The packed [L, H, D] layout of FlashKernel, segments reshaped to a batch."""

    def __init__(self, scale):
        self.scale = scale

    def forward(self, q, k, v, causal, segments):
        batch = lambda x: x.reshape(segments, -1, *x.shape[1:])  # noqa: E731
        out, lse = math_attention(batch(q), batch(k), batch(v), self.scale, causal)
        return out.reshape(q.shape), lse.transpose(1, 2).reshape(q.shape[:2])[..., None], None

    def backward(self, dout, q, k, v, out, lse, saved, causal, segments):
        batch = lambda x: x.reshape(segments, -1, *x.shape[1:])  # noqa: E731
        lse_b = batch(lse[..., 0]).transpose(1, 2)
        grads = math_attention_backward(
            *(batch(x) for x in (dout, q, k, v, out)), lse_b, self.scale, causal
        )
        return tuple(g.reshape(x.shape) for g, x in zip(grads, (q, k, v)))


class MathAten(ba.AtenKernel):
    """AtenKernel's [B, H, L, D] layout (K/V expanded, segments as the batch), math inside."""

    def forward(self, q, k, v, causal, segments):
        out, lse = math_attention(*(x.transpose(1, 2) for x in (q, k, v)), self.c.scale, causal)
        return out.transpose(1, 2), lse[..., None], None

    def backward(self, dout, q, k, v, out, lse, saved, causal, segments):
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        grads = math_attention_backward(
            *(t(x) for x in (dout, q, k, v, out)), lse[..., 0], self.c.scale, causal
        )
        return tuple(t(g) for g in grads)


def reference(c):
    q, k, v = (t.detach().double().requires_grad_() for t in (c.q, c.k, c.v))
    prefix = [p for p, _ in c.groups]
    out, _ = unshared_attention(q, k, v, prefix, [rs for _, rs in c.groups], c.scale)
    out.backward(c.dout.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def assert_matches(got, want):
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g.double(), w, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("layout", ["flash", "aten"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_three_pass_composition(layout, hq, hkv, seed):
    n, p, r = 3, 13, 5
    c = ba.Case([(p, [r] * n)], hq, hkv, 8, device="cpu", dtype=torch.float64, seed=seed)
    kernel = MathFlash(c.scale) if layout == "flash" else MathAten(c, "math")
    run = ba.run_3pass(c, kernel)
    assert_matches([run.packed_out(), *run.packed_grads()], reference(c))
    run.forward_backward()  # the timed callables run too
    assert kernel.packed(run.forward()).shape == c.q.shape


def test_three_pass_skips_what_it_does_not_compose():
    plain = ba.Case([(16, [0])], 2, 2, 8, device="cpu", dtype=torch.float64)
    groups = ba.Case([(5, [3, 3]), (4, [2])], 2, 2, 8, device="cpu", dtype=torch.float64)
    unequal = ba.Case([(5, [3, 4])], 2, 2, 8, device="cpu", dtype=torch.float64)
    with pytest.raises(ba.Skip, match="R = 0"):
        ba.run_3pass(plain, MathFlash(plain.scale))
    for c in (groups, unequal):
        with pytest.raises(ba.Skip, match="one group of equal R"):
            ba.run_3pass(c, MathFlash(c.scale))


def varlen_math(q, k, v, cu, max_len):
    """Causal attention of each cu_seqlens segment of the concatenated rows."""
    cu = cu.tolist()
    scale = 1.0 / math.sqrt(q.shape[-1])
    outs = [
        math_attention(q[None, a:b], k[None, a:b], v[None, a:b], scale, True)[0][0]
        for a, b in zip(cu[:-1], cu[1:])
    ]
    assert max(b - a for a, b in zip(cu[:-1], cu[1:])) == max_len
    return torch.cat(outs)


@pytest.mark.parametrize(
    "groups", [[(9, [4, 4, 4])], [(7, [3, 5]), (4, [2]), (0, [3]), (5, [])]], ids=["one", "many"]
)
def test_rows_gradients_map_back_to_the_packed_layout(groups, seed):
    """The varlen rows (FA4 / ffpa-attn methods) and SDPA's padded rows, run with a plain
    kernel, give the packed layout's output and gradients."""
    c = ba.Case(groups, 4, 2, 8, device="cpu", dtype=torch.float64, seed=seed)
    want = reference(c)
    for run in (
        ba.run_varlen_rows(c, varlen_math),
        ba.run_sdpa(c, torch.nn.attention.SDPBackend.MATH),
    ):
        assert_matches([run.packed_out(), *run.packed_grads()], want)


def test_check_passes_dualkv_fails_a_wrong_method_and_skips(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", None)  # FA4 not installed

    def wrong(c):  # DualKV with its output off by 2%: the check must catch it
        run = ba.run_dualkv(c)
        return run._replace(packed_out=lambda: 1.02 * run.packed_out())

    monkeypatch.setitem(ba.RUNNERS, "wrong", wrong)
    methods = ["dualkv", "wrong", "fa4-rows", "fa4-3pass", "ffpa-rows"]
    status = ba.check_methods(methods, 4, 2, 64, device="cpu")
    assert status["dualkv"] == "ok"
    assert status["wrong"].startswith("FAIL out")
    assert status["fa4-rows"].startswith("skipped: flash-attn-4 not available")
    assert status["fa4-3pass"].startswith("skipped: flash-attn-4 not available")
    assert status["ffpa-rows"] == "skipped: " + ba.HEAD_DIMS["ffpa-rows"][2]


def test_command_line_subsets():
    args, shapes, methods = ba.parse_args(
        ["--shapes", "plain", "--head-dims", "128", "--methods", "dualkv,fa4-rows"]
    )
    assert shapes == [sh for sh in ba.SHAPES if sh[:3] in ((1, 8192, 0), (1, 16384, 0))
                      and sh[5] == 128]  # fmt: skip
    assert len(shapes) == 4 and methods == ["dualkv", "fa4-rows"] and args.check
    _, shapes, _ = ba.parse_args(["--shapes", "0,packed,d512", "--no-check"])
    assert shapes == [ba.SHAPES[i] for i in dict.fromkeys([0, *ba.SHAPE_SETS["packed"],
                                                          *ba.SHAPE_SETS["d512"]])]  # fmt: skip
    _, shapes, _ = ba.parse_args(["--shape", "1,4096,0,8,8,64", "--multi", "16,8,128"])
    assert shapes == [(1, 4096, 0, 8, 8, 64), (0, 0, 0, 16, 8, 128)]
    for bad in (["--methods", "dualkv,fa5"], ["--shapes", "nope"], ["--shape", "1,2,3"],
                ["--shapes", "plain", "--head-dims", "96"]):  # fmt: skip
        with pytest.raises(SystemExit):
            ba.parse_args(bad)
    # every default method and shape set is known
    assert set(ba.METHODS + ba.EXTRA_METHODS) == set(ba.RUNNERS)
    assert all(i < len(ba.SHAPES) for s in ba.SHAPE_SETS.values() for i in s)
