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
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_response_logprobs_fullgraph(device: str, backend: str, seed: int) -> None:
    """The chunked log-probs (dualkv::logit_stats, the in-place dualkv::logit_grad_) trace too."""
    torch.manual_seed(seed)
    prompts, responses = [[1, 2, 3], [4, 5]], [[[6, 7], [8]], [[9, 10, 11]]]
    pk = dualkv.pack(prompts=prompts, responses=responses, device=device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    h = torch.randn(pk.total_tokens, 16, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(50, 16, device=device, dtype=dtype, requires_grad=True)

    def step(h, w):  # noqa: ANN001, ANN202
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
    # On CUDA the compiled backward adds the chunks' head-gradient products after rounding them
    # to bf16 (eagerly one GEMM accumulates them in fp32): bf16-level differences.
    tol = {} if device == "cpu" else {"rtol": 2e-2, "atol": 2e-3}
    for a, b in zip(grads_c, grads_e):
        torch.testing.assert_close(a, b, **tol)
