"""torch.compile(fullgraph=True) traces dualkv.attention and dualkv.response_logprobs (forward and
backward) without breaks."""

from __future__ import annotations

import pytest
import torch

import dualkv

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(device: str, backend: str, seed: int) -> None:
    torch.manual_seed(seed)
    layout = dualkv.Layout([20, 5], [[7, 3], [4]], device=device)
    T = layout.total_tokens
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = (
        torch.randn(T, h, 64, device=device, dtype=dtype, requires_grad=True) for h in (4, 2, 2)
    )

    def step(q, k, v):  # noqa: ANN001, ANN202
        out, lse = dualkv.attention(q * 1.5, k, v, layout, window=9, return_lse=True)
        return (out.float() ** 2).sum() + lse.sum()

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    loss_c = compiled(q, k, v)
    grads_c = torch.autograd.grad(loss_c, (q, k, v))
    loss_e = step(q, k, v)
    grads_e = torch.autograd.grad(loss_e, (q, k, v))
    torch.testing.assert_close(loss_c, loss_e)
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_one_graph_for_all_layouts(device: str, seed: int) -> None:
    """In training every batch has its own layout: after the first change of sizes the compiled
    graph is dynamic and serves all later layouts (no recompilation per batch, which would end in
    dynamo's recompile limit and a silent fallback to eager)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(seed)

    def step(q, k, v, layout):  # noqa: ANN001, ANN202
        return (dualkv.attention(q, k, v, layout, window=7).float() ** 2).sum()

    compiled = torch.compile(
        step, fullgraph=True, backend="inductor" if device != "cpu" else "aot_eager"
    )
    layouts = [
        ([9], [[4, 3]]),
        ([5, 12], [[6], [2, 8, 1]]),
        ([30], [[1] * 5]),
        ([3, 4, 2], [[7], [9, 9], []]),
        ([17], [[11, 2, 5]]),
    ]
    for prefix, resp in layouts:
        layout = dualkv.Layout(prefix, resp, device=device)
        qkv = [
            torch.randn(layout.total_tokens, h, 64, generator=gen)
            .to(device, dtype)
            .requires_grad_()
            for h in (4, 2, 2)
        ]
        got = torch.autograd.grad(compiled(*qkv, layout), qkv)
        want = torch.autograd.grad(step(*qkv, layout), qkv)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    torch._dynamo.reset()


@pytest.mark.parametrize("device", DEVICES)
def test_compile_response_logprobs_one_graph_for_all_batches(device: str, seed: int) -> None:
    """A compiled log-prob function (as trainers compile theirs) sees one opaque chunked op with
    symbolic sizes: batches with other token and row counts reuse the graph, and the values are
    the eager ones."""
    import random

    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rng = random.Random(seed)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    w = torch.randn(40, 16, device=device, dtype=dtype, requires_grad=True)

    def step(h, w, pk):  # noqa: ANN001, ANN202
        lp, en = dualkv.response_logprobs(h, w, pk, return_entropy=True, chunk_size=5)
        return (lp * 2).sum() + en.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    for _ in range(6):
        groups = rng.randint(2, 3)
        prompts = [[rng.randrange(40) for _ in range(rng.randint(2, 9))] for _ in range(groups)]
        responses = [
            [
                [rng.randrange(40) for _ in range(rng.randint(1, 8))]
                for _ in range(rng.randint(2, 4))
            ]
            for _ in range(groups)
        ]
        pk = dualkv.pack(prompts=prompts, responses=responses, device=device)
        h = torch.randn(pk.total_tokens, 16, device=device, dtype=dtype, requires_grad=True)
        got = torch.autograd.grad(compiled(h, w, pk), (h, w))
        want = torch.autograd.grad(step(h, w, pk), (h, w))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    torch._dynamo.reset()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_response_logprobs_fullgraph(device: str, backend: str, seed: int) -> None:
    """The chunked log-probs (dualkv::logit_stats, the in-place dualkv::logit_grad_) trace too."""
    torch.manual_seed(seed)
    prompts, responses = [[1, 2, 3], [4, 5]], [[[6, 7], [8]], [[9, 10, 11]]]
    pk = dualkv.pack(prompts=prompts, responses=responses, device=device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    h = torch.randn(pk.total_tokens, 16, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(50, 16, device=device, dtype=dtype, requires_grad=True)

    def step(h, w, pk=pk):  # noqa: ANN001, ANN202
        lp, en = dualkv.response_logprobs(
            h, w, pk, temperature=0.8, return_entropy=True, logit_softcap=4.0, chunk_size=3
        )
        return (lp * 2).sum() + en.sum()

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    loss_c = compiled(h, w)
    grads_c = torch.autograd.grad(loss_c, (h, w))
    loss_e = step(h, w)
    grads_e = torch.autograd.grad(loss_e, (h, w))
    torch.testing.assert_close(loss_c, loss_e)
    if device == "cpu":
        for a, b in zip(grads_c, grads_e):
            torch.testing.assert_close(a, b)
        return
    # On CUDA the compiled backward adds the chunks' head-gradient products after rounding them
    # to bf16 (eagerly one GEMM accumulates them in fp32): against the same step in float64,
    # the compiled gradients' error stays within a small multiple of the eager bf16 ones'.
    h64, w64 = (x.detach().double().cpu().requires_grad_() for x in (h, w))
    grads_ref = torch.autograd.grad(step(h64, w64, pk.to("cpu")), (h64, w64))
    for c, e, r in zip(grads_c, grads_e, grads_ref):
        err_c = (c.double().cpu() - r).abs().max().item()
        err_e = (e.double().cpu() - r).abs().max().item()
        assert err_c <= 3 * err_e + 1e-3 * r.abs().max().item(), (err_c, err_e)


def test_compile_response_logprobs_changing_temperature(seed: int) -> None:
    """A second temperature makes dynamo trace it as a symbolic float: the range check is then an
    assert in the graph (it was a Python check, which fullgraph=True could not trace)."""
    import torch._dynamo

    torch.manual_seed(seed)
    pk = dualkv.pack(prompts=[[5, 6, 7]], responses=[[[1, 2, 3], [4]]])
    h, w = torch.randn(pk.total_tokens, 8), torch.randn(30, 8)

    def step(h, w, t):  # noqa: ANN001, ANN202
        return dualkv.response_logprobs(h, w, pk, temperature=t)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    try:
        for t in (1.0, 0.5, 0.7, 1.3):
            torch.testing.assert_close(compiled(h, w, t), step(h, w, t))
        for t in (-1.0, 0.0, float("inf")):
            with pytest.raises((RuntimeError, ValueError), match="temperature"):
                compiled(h, w, t)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("move", [False, True], ids=["build", "to"])
def test_layout_built_inside_compiled_code(move: bool, seed: int) -> None:
    """A Layout built (or moved with .to) inside the compiled function: the dynamo trace of
    dualkv::layout_tables (no fake implementation) and of maybe_mark_dynamic crashed, even
    without fullgraph. It is now a graph break (run eagerly, results equal to eager), and a clear
    error under fullgraph=True."""
    import torch._dynamo

    gen = torch.Generator().manual_seed(seed)
    outer = dualkv.Layout([3], [[2]])

    def step(q, k, v, prefix, resp):  # noqa: ANN001, ANN202
        layout = outer.to("cpu") if move else dualkv.Layout(prefix, resp)
        return dualkv.attention(q * 2, k, v, layout, return_lse=True)

    for prefix, resp in ([[3], [[2]]], [[4, 0], [[3, 1], [2]]]) if not move else ([[3], [[2]]],):
        T = sum(prefix) + sum(map(sum, resp))
        q, k, v = (torch.randn(T, h, 8, generator=gen) for h in (4, 2, 2))
        torch._dynamo.reset()
        got = torch.compile(step, backend="aot_eager")(q, k, v, prefix, resp)
        want = step(q, k, v, prefix, resp)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="built on the host, outside the compiled graph"):
            torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v, prefix, resp)
