"""bench/attention.py's baselines, on CPU: the 3-pass + lse-merge composition (run with a plain
PyTorch kernel in each of the two tensor layouts its GPU kernels use), the rows methods' gradients
mapped back to the packed layout (prompt groups and prefix trees), the correctness check's rows
reference and the check itself (it passes DualKV, fails a wrong method, skips a missing package or
head dim with the reason; at CHECK_TREE for trees) and the command line. The oracles are
dualkv.reference's unshared rows and test_tree's root-to-leaf rows, in float64."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from dualkv.reference import unshared_attention
from test_tree import rows_attention as tree_rows_attention

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
    """out, dq, dk, dv of the unshared rows in float64: dualkv.reference for groups, test_tree's
    rows for a tree (each token's output from the first row holding it)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (c.q, c.k, c.v))
    if c.groups is None:
        forest = (list(c.layout.parents), list(c.layout.lengths))
        out, _ = tree_rows_attention(q, k, v, forest, c.scale, None, 0.0)
    else:
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


SMALL_TREE = ba.TreeBatch(  # two trees, depth 3, a row that ends where its tree goes on
    "small", [-1, 0, 1, 1, 0, -1, 5], [6, 3, 4, 2, 5, 7, 1],
    [(2, 1), (3, 3), (1, 1), (4, 4), (6, 6)], [0, 0, 0, 0, 1],
)  # fmt: skip


@pytest.mark.parametrize(
    "groups",
    [[(9, [4, 4, 4])], [(7, [3, 5]), (4, [2]), (0, [3]), (5, [])], SMALL_TREE, ba.CHECK_TREE],
    ids=["one", "many", "tree", "check-tree"],
)
def test_rows_gradients_map_back_to_the_packed_layout(groups, seed):
    """The varlen rows (FA4 / ffpa-attn methods) and SDPA's padded rows, run with a plain
    kernel, give the packed layout's output and gradients; so does the check's rows
    reference."""
    c = ba.Case(groups, 4, 2, 8, device="cpu", dtype=torch.float64, seed=seed)
    want = reference(c)
    for run in (
        ba.run_varlen_rows(c, varlen_math),
        ba.run_sdpa(c, torch.nn.attention.SDPBackend.MATH),
    ):
        assert_matches([run.packed_out(), *run.packed_grads()], want)
    q, k, v = c.leaves(c.q, c.k, c.v)
    out = ba.rows_reference(c, q, k, v)
    out.backward(c.dout)
    assert_matches([out.detach(), *ba.grads_of([q, k, v])], want)


@pytest.mark.parametrize("segments", ["packed", "listed"])
def test_tree_case_rows(segments):
    """A tree's rows are its root-to-leaf paths, a row that ends inside the tree included (the
    empty leaf of TreeBatch.layout_forest), and its token reduction is theirs, on the packer's
    segments (tree 1's only child merged into its root) or the listed ones."""
    c = ba.Case(SMALL_TREE, 2, 1, 8, device="cpu", dtype=torch.float64, tree_segments=segments)
    assert c.layout.is_tree and c.groups is None and not c.single
    if segments == "packed":
        assert list(c.layout.parents) == [-1, 0, 1, 1, 0, -1]
        assert list(c.layout.lengths) == [6, 3, 4, 2, 5, 8]
    else:
        assert list(c.layout.parents)[:7] == SMALL_TREE.parents
    cu = c.rows_cu.tolist()
    rows = [c.rows_index[a:b].tolist() for a, b in zip(cu[:-1], cu[1:])]
    assert rows == [
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],  # 0 -> 1 -> 2
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 13, 14],  # 0 -> 1 -> 3
        [0, 1, 2, 3, 4, 5, 15, 16, 17, 18, 19],  # 0 -> 4
        list(range(20, 28)),  # 5 -> 6
        [0, 1, 2, 3, 4, 5, 6, 7, 8],  # 0 -> 1, the row that ends inside
    ]
    assert sum(map(len, rows)) == SMALL_TREE.row_tokens
    assert c.rho == SMALL_TREE.row_tokens / SMALL_TREE.packed_tokens
    # each token's source: the first row holding it
    src = c.rows_index[c.rows_source]
    assert torch.equal(src, torch.arange(c.layout.total_tokens))
    with pytest.raises(ba.Skip, match="one group of equal R"):
        ba.run_3pass(c, MathFlash(c.scale))


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
    status = ba.check_methods(["dualkv", "wrong", "fa4-3pass"], 4, 2, 64, device="cpu", tree=True)
    assert status["dualkv"] == "ok"
    assert status["wrong"].startswith("FAIL out")
    assert status["fa4-3pass"].startswith("skipped: ")


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
    _, shapes, _ = ba.parse_args(["--shapes", "tree,tree-d2"])
    issue = ["branching", "agentic", "sysprompt"]
    assert shapes[:3] == [(name, 0, 0, *ba.TREE_HEADS) for name in issue]
    assert shapes[3:] == [(*ba.TREES[name]().twin(), *ba.TREE_HEADS) for name in issue]
    _, shapes, _ = ba.parse_args(["--shapes", "tree-deep"])
    assert shapes == [("long-horizon", 0, 0, *ba.TREE_HEADS),
                      (*ba.TREES["long-horizon"]().twin(), *ba.TREE_HEADS)]  # fmt: skip
    args, shapes, _ = ba.parse_args(["--summary", "a.json", "b.json"])
    assert args.summary == ["a.json", "b.json"] and shapes == []
    _, shapes, _ = ba.parse_args(["--tree", "agentic,16,8,128", "--tree", "branching,32,8,64"])
    assert shapes == [("agentic", 0, 0, 16, 8, 128), ("branching", 0, 0, 32, 8, 64)]
    for bad in (["--tree", "forest,16,8,128"], ["--tree", "agentic,16,8"]):
        with pytest.raises(SystemExit):
            ba.parse_args(bad)
    # every default method and shape set is known
    assert set(ba.METHODS + ba.EXTRA_METHODS) == set(ba.RUNNERS)
    assert all(i < len(ba.SHAPES) for s in ba.SHAPE_SETS.values() for i in s)


def test_tree_summary():
    """The issue's comparisons from timed rows: tree vs its depth-two twin (TF/s ratio, bar 0.9)
    and speed-ups over the other methods on the tree (bar 2x over Flex)."""
    n, p, r = ba.TREES["agentic"]().twin()
    heads = " Hq=32 Hkv=8 D=128"
    tree = "agentic T=78023" + heads

    def row(shape, method, ms, tflops):
        return dict(shape=shape, method=method, fwd_bwd_ms=ms, fwd_bwd_tflops=tflops, rho=8.99)

    rows = [
        row(tree, "dualkv", 50.0, 380.0),
        row(tree, "flex", 120.0, 158.0),
        row(tree, "sdpa_cudnn", 400.0, 47.0),
        dict(shape=tree, method="fa4-rows", error="skipped: flash-attn-4 not available"),
        row(f"N={n} P={p} R={r}" + heads, "dualkv", 60.0, 400.0),
        row("N=16 P=8192 R=1024" + heads, "dualkv", 24.0, 413.0),
    ]
    (line,) = ba.tree_summary(rows)
    assert line.startswith(f"{tree}: rho 8.99, DualKV 380 TF/s; 0.95 of the depth-two twin's 400")
    assert "(bar 0.90: met)" in line and "2.40x flex (bar 2x: met)" in line
    assert "8.00x sdpa_cudnn" in line and "fa4" not in line
    rows[0]["fwd_bwd_tflops"] = 300.0
    rows[0]["fwd_bwd_ms"] = 70.0
    (line,) = ba.tree_summary(rows)
    assert "0.75 of the depth-two twin's" in line and "NOT met" in line
    assert ba.tree_summary(rows[4:]) == []


def test_main_runs_a_tree_and_its_twin_on_cpu(tmp_path, monkeypatch, capsys):
    """The whole command (check, timing loop, table, JSON, summary) on a tiny agentic tree and its
    depth-two twin, with the CUDA-only parts replaced: CPU tensors, a wall-clock timer."""
    import json
    import time

    import trees

    tiny = trees.agentic(tasks=1, scale=0.02)
    monkeypatch.setitem(ba.TREES, "agentic", lambda: tiny)
    monkeypatch.setattr(ba.Case.__init__, "__defaults__", ("cpu", torch.float32, 0, "packed"))
    monkeypatch.setattr(ba.check_methods, "__defaults__", ("cpu", False))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "CPU")

    def wall_ms(fn, warmup, repeats, lead_spin=False):
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)

    monkeypatch.setattr(ba, "time_ms", wall_ms)
    n, p, r = tiny.twin()
    argv = ["attention.py", "--tree", "agentic,4,2,16", "--shape", f"{n},{p},{r},4,2,16",
            "--methods", "dualkv,flex", "--out", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    ba.main()
    saved = json.loads((tmp_path / "attention.json").read_text())
    assert saved["checks"]["4,2,16,tree"]["dualkv"] == "ok"
    assert saved["checks"]["4,2,16"]["dualkv"] == "ok"
    twin_row, _, tree_row, flex_row = saved["rows"]  # (--shape's shapes come first)
    assert tree_row["method"] == "dualkv" and tree_row["shape"].startswith("agentic T=")
    assert tree_row["rho"] == pytest.approx(tiny.row_tokens / tiny.packed_tokens)
    assert "error" in flex_row  # (FlexAttention has no CPU backward)
    assert twin_row["shape"] == f"N={n} P={p} R={r} Hq=4 Hkv=2 D=16"
    out = capsys.readouterr().out
    assert "of the depth-two twin's" in out and "token reduction rho" in out
    monkeypatch.setattr(
        sys, "argv", ["attention.py", "--summary", str(tmp_path / "attention.json")]
    )
    ba.main()
    assert capsys.readouterr().out.startswith(tree_row["shape"] + ": rho")
