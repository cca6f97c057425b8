"""dualkv.attention equals causal attention over the N unshared rows: outputs, lse, gradients.

Tolerance (DESIGN.md, FlashAttention's rule): the kernel's max error against the float64
reference of the unshared rows must be at most 2x (3x for gradients) the error of a plain PyTorch
implementation run in the same precision, plus a tiny absolute slack."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dualkv
from dualkv.reference import random_layout_lens, unshared_attention
from oracle import dense_attention

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SLACK = {torch.float64: 1e-10, torch.float32: 2e-6, torch.bfloat16: 1e-4, torch.float16: 1e-5}
# Gradients: the FlashAttention-style backward forms dS = P * (dP - delta) with
# delta = rowsum(dO * O), two float32 dot products of magnitude ~sqrt(D) whose difference can be
# far smaller (one visible key: exactly dlse), so dq/dk carry ~eps * sqrt(D) absolute rounding
# even where the plain autograd path cancels exactly (seed 2830012812, a one-token layout:
# dq error 2.8e-6 at D = 128, plain 4.8e-8). The float32 slack of the gradients covers that.
GRAD_SLACK = {**SLACK, torch.float32: 1e-5}


def grad_atol(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """FlashAttention's tests' absolute tolerance of a gradient: twice the rounding of the
    reference's values (offset by 0.3) in the test dtype, ~2 ulps of the gradient's magnitude.
    In 16 bits it covers what delta = rowsum(dO * O) inherits from the rounded forward output O
    (~eps * |O| * |dO| * sqrt(D) in every dS = P (dP - delta)): on a layout of one prompt token
    and responses [1, 0, 1] (seed 1749036699, bf16, D = 64) dk erred 2.9e-2 where the plain
    autograd path, which never forms delta, erred 8.1e-3; in float32 both are exact to 6e-7."""
    if dtype not in (torch.bfloat16, torch.float16):
        return 0.0
    r = ref.to(dtype)
    return 2 * max_err(r + 0.3 - 0.3, r)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double().cpu() - b.double().cpu()).abs().max().item() if a.numel() else 0.0


def assert_close(
    name: str,
    got: torch.Tensor,
    ref: torch.Tensor,
    plain: torch.Tensor,
    factor: float,
    slack: float,
) -> None:
    assert not torch.isnan(got).any(), f"{name}: NaN in output"
    finite = torch.isfinite(ref.cpu())
    assert torch.equal(torch.isfinite(got.cpu()), finite), f"{name}: non-finite pattern differs"
    g, r, p = (t.cpu().double().masked_fill(~finite, 0) for t in (got, ref, plain))
    err, base = max_err(g, r), max_err(p, r)
    assert err <= factor * base + slack, (
        f"{name}: error {err:.3e} > {factor} x {base:.3e} + {slack}"
    )


def run_case(
    lens: tuple[list[int], list[list[int]]],
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    device: str,
    window: int | None,
    softcap: float,
    seed: int,
    magnitude: float = 1.0,
) -> None:
    prefix, resp = lens
    layout = dualkv.Layout(prefix, resp, device=device)
    T = layout.total_tokens
    gen = torch.Generator().manual_seed(seed)
    q64, k64, v64 = (
        torch.randn(T, h, d, generator=gen, dtype=torch.float64) * magnitude for h in (hq, hkv, hkv)
    )
    dout64 = torch.randn(T, hq, d, generator=gen, dtype=torch.float64)
    dlse64 = torch.randn(hq, T, generator=gen, dtype=torch.float64)
    scale = 1.0 / math.sqrt(d)
    # Inputs rounded to the test dtype; the fp64 reference sees exactly those values.
    q, k, v = (t.to(dtype) for t in (q64, k64, v64))

    def grads(fn, inputs, dout, dlse):  # noqa: ANN001, ANN202
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out, lse = fn(*leaves)
        loss = (out.to(dout.dtype) * dout).sum() + (
            lse.to(dlse.dtype) * dlse.masked_fill(~torch.isfinite(lse), 0)
        ).sum()
        if loss.requires_grad:  # not for T = 0, where the reference has no graph
            loss.backward()
        return [out.detach(), lse.detach()] + [
            t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves
        ]

    def ref(dt: torch.dtype, dev: str, oracle=unshared_attention):  # noqa: ANN001, ANN202
        def fn(q_, k_, v_):  # noqa: ANN001, ANN202
            return oracle(q_, k_, v_, prefix, resp, scale, window, softcap)

        return grads(
            fn,
            [t.to(dev, dt) for t in (q, k, v)],
            dout64.to(dev, dt),
            dlse64.to(dev, torch.float64 if dt == torch.float64 else torch.float32),
        )

    def kernel(q_, k_, v_):  # noqa: ANN001, ANN202
        return dualkv.attention(q_, k_, v_, layout, window=window, softcap=softcap, return_lse=True)

    got = grads(
        kernel,
        [t.to(device) for t in (q, k, v)],
        dout64.to(device, dtype),
        dlse64.to(device, torch.float64 if dtype == torch.float64 else torch.float32),
    )
    # The oracle: a dense mask from DESIGN.md's rule (tests/python/oracle.py), independent of
    # the package; the plain same-precision yardstick: the package's unshared rows, which must
    # themselves agree with the oracle in float64.
    exact = ref(torch.float64, "cpu", dense_attention)
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], ref(torch.float64, "cpu"), exact):
        assert (
            max_err(a.masked_fill(~torch.isfinite(b), 0), b.masked_fill(~torch.isfinite(b), 0))
            < 1e-9
        ), name
    plain = ref(dtype, device)
    for name, g, r, p, factor in zip(
        ["out", "lse", "dq", "dk", "dv"], got, exact, plain, [2, 2, 3, 3, 3]
    ):
        assert g.shape == r.shape, f"{name}: shape {tuple(g.shape)} != {tuple(r.shape)}"
        slack = (GRAD_SLACK if name.startswith("d") else SLACK)[dtype]
        slack *= 1 if name == "lse" else magnitude
        if name.startswith("d"):
            slack = max(slack, grad_atol(r.masked_fill(~torch.isfinite(r), 0), dtype))
        assert_close(name, g, r, p, factor, slack)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "hq,hkv", [(4, 4), (8, 2), (8, 1), (16, 2)], ids=["1:1", "4:1", "MQA", "8:1"]
)
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("d", [64, 128])
def test_equivalence(
    device: str,
    dtype: torch.dtype,
    hq: int,
    hkv: int,
    window: int | None,
    softcap: float,
    d: int,
    seed: int,
) -> None:
    if device == "cuda" and dtype in (torch.float32, torch.float64):
        pytest.skip("float32/float64 are CPU-only dtypes")
    if (
        device == "cpu"
        and dtype == torch.float16
        and (hq, window, softcap, d) != (8, None, 0.0, 64)
    ):
        pytest.skip("float16 on CPU: covered by one representative case")
    rng = random.Random(seed)
    lens = random_layout_lens(rng, groups=rng.randint(1, 3), max_p=200, max_r=150)
    run_case(lens, hq, hkv, d, dtype, device, window, softcap, seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [256, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, 0.0), (50, 3.0)])
def test_large_head_dims(
    device: str, d: int, dtype: torch.dtype, window: int | None, softcap: float, seed: int
) -> None:
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("float32 is a CPU-only dtype")
    rng = random.Random(seed)
    lens = random_layout_lens(rng, groups=2, max_p=150, max_n=3, max_r=100)
    run_case(lens, 4, 2, d, dtype, device, window, softcap, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 1), (16, 2)], ids=["1:1", "MQA", "8:1"])
@pytest.mark.parametrize("window,softcap", [(None, 0.0), (37, 5.0)])
def test_head_dim_512_gpu(
    dtype: torch.dtype, hq: int, hkv: int, window: int | None, softcap: float, seed: int
) -> None:
    """Head dim 512 (Gemma 4's global layers) on the GPU: both dtypes, GQA ratios and MQA."""
    rng = random.Random(seed)
    lens = random_layout_lens(rng, groups=rng.randint(1, 3), max_p=300, max_r=200)
    run_case(lens, hq, hkv, 512, dtype, "cuda", window, softcap, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window,softcap", [(None, 0.0), (37, 5.0)])
def test_separate_dq_pass(
    d: int,
    window: int | None,
    softcap: float,
    seed: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DUALKV_FUSED_DQ=0 (the A/B switch) runs the separate dQ pass in the default mode instead of
    the fused dQ of the sm_90a backward (head dims 64, 128): the same gradients."""
    monkeypatch.setenv("DUALKV_FUSED_DQ", "0")
    rng = random.Random(seed)
    lens = random_layout_lens(rng, groups=rng.randint(1, 3), max_p=300, max_r=200)
    run_case(lens, 8, 2, d, torch.bfloat16, "cuda", window, softcap, seed)


EDGE_LAYOUTS = [
    ([], []),  # no groups
    ([0], [[0]]),  # T = 0
    ([7], [[]]),  # N = 0: prompt only
    ([0], [[5, 1, 0]]),  # P = 0
    ([1], [[1, 0, 1]]),  # one-token prompt and responses
    ([5], [[0, 0]]),  # R = 0 responses
    ([130], [[129, 1, 257]]),  # lengths off the 128-token tile
    ([0, 3, 128, 1], [[2], [], [128, 0, 3], [1]]),  # mixed groups
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("lens", EDGE_LAYOUTS, ids=[str(i) for i in range(len(EDGE_LAYOUTS))])
def test_edge_layouts(device: str, dtype: torch.dtype, lens, seed: int) -> None:  # noqa: ANN001
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 is a CPU-only dtype")
    run_case(lens, 4, 2, 64, dtype, device, None, 0.0, seed)
    run_case(lens, 4, 2, 64, dtype, device, 2, 0.0, seed + 1)
    if device == "cuda":  # head dim 512 has its own tiles (half-tile CTAs, split columns)
        run_case(lens, 4, 2, 512, dtype, device, None, 0.0, seed + 2)


@pytest.mark.parametrize("device", DEVICES)
def test_large_magnitude(device: str, seed: int) -> None:
    rng = random.Random(seed)
    lens = random_layout_lens(rng, groups=2, edge=False)
    run_case(lens, 8, 2, 64, torch.bfloat16, device, None, 0.0, seed, magnitude=20.0)
    run_case(lens, 8, 2, 64, torch.bfloat16, device, None, 30.0, seed, magnitude=20.0)


def test_gradcheck_fp64(seed: int) -> None:
    layout = dualkv.Layout([3, 0], [[2, 1, 0], [2]])
    gen = torch.Generator().manual_seed(seed)
    T = layout.total_tokens
    q = torch.randn(T, 4, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(T, 2, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(T, 2, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    for window, softcap in [(None, 0.0), (2, 0.0), (None, 2.0)]:

        def fn(q_, k_, v_, window=window, softcap=softcap):  # noqa: ANN001, ANN202
            return dualkv.attention(
                q_, k_, v_, layout, window=window, softcap=softcap, return_lse=True
            )

        assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_strided_inputs(device: str, dtype: torch.dtype, seed: int) -> None:
    """q, k, v as views into one fused qkv projection give the same outputs and gradients as
    contiguous copies (and the gradients land in the fused tensor's slices)."""
    if device == "cuda" and dtype == torch.float64:
        pytest.skip("float64 is a CPU-only dtype")
    layout = dualkv.Layout([40, 9], [[17, 3], [0, 30]], device=device)
    T = layout.total_tokens
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, 8 + 2 + 2, 64, generator=gen).to(device, dtype).requires_grad_()
    dout = torch.randn(T, 8, 64, generator=gen).to(device, dtype)
    a = dualkv.attention(qkv[:, :8], qkv[:, 8:10], qkv[:, 10:], layout)
    a.backward(dout)
    copies = [qkv.detach()[:, sl].contiguous().requires_grad_() for sl in
              (slice(0, 8), slice(8, 10), slice(10, 12))]  # fmt: skip
    b = dualkv.attention(*copies, layout)
    b.backward(dout)
    assert torch.equal(a, b)
    assert qkv.grad is not None
    assert torch.equal(qkv.grad, torch.cat([c.grad for c in copies], dim=1))
    assert qkv.grad.abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_backward(device: str, seed: int) -> None:
    rng = random.Random(seed)
    layout = dualkv.Layout(*random_layout_lens(rng, groups=3, edge=False), device=device)
    T = layout.total_tokens
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, h, 64, generator=gen).to(device, torch.bfloat16) for h in (8, 2, 2))
    dout = torch.randn(T, 8, 64, generator=gen).to(device, torch.bfloat16)

    def run() -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = dualkv.attention(*leaves, layout, deterministic=True)
        out.backward(dout)
        return [out.detach()] + [t.grad for t in leaves]

    first = run()
    for _ in range(5):
        for a, b in zip(first, run()):
            assert torch.equal(a, b)


class _OpArgs(TorchDispatchMode):
    """Records the `deterministic` argument (the last) of every dualkv op call."""

    def __init__(self) -> None:
        super().__init__()
        self.deterministic: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func.namespace == "dualkv":
            self.deterministic.append((func.__name__, args[-1]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_reaches_the_ops(device: str, seed: int) -> None:
    """deterministic=True, and torch.use_deterministic_algorithms(True) (warn_only too), reach the
    forward op and, through autograd, the backward op; the default reaches them as False."""
    layout = dualkv.Layout([37], [[5, 20]], device=device)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(layout.total_tokens, 4, 64, generator=gen).to(device, torch.bfloat16)
    kv = torch.randn(layout.total_tokens, 2, 64, generator=gen).to(device, torch.bfloat16)
    was, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    try:
        for det, global_det, global_warn_only, expect in [
            (False, False, False, False),
            (True, False, False, True),
            (False, True, False, True),
            (False, True, True, True),
        ]:
            torch.use_deterministic_algorithms(global_det, warn_only=global_warn_only)
            leaf = q.clone().requires_grad_()
            rec = _OpArgs()
            with rec:
                dualkv.attention(leaf, kv, kv, layout, deterministic=det).float().sum().backward()
            assert rec.deterministic == [("fwd.default", expect), ("bwd.default", expect)], (
                det, global_det, global_warn_only, rec.deterministic
            )  # fmt: skip
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)
