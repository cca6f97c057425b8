"""GPU-only behaviour of the CUDA backend: races, CUDA-graph capture, no host synchronisation,
unsupported cases. (Numerical equivalence on the GPU runs in test_attention.py's cuda cases.)"""

from __future__ import annotations

import random

import pytest
import torch

import dualkv
from dualkv.reference import random_layout_lens

pytestmark = pytest.mark.gpu


def inputs(layout: dualkv.Layout, hq: int, hkv: int, d: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = layout.total_tokens
    return [
        torch.randn(T, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        for h in (hq, hkv, hkv, hq)
    ]


def fwd_bwd(q, k, v, dout, layout, **kw):  # noqa: ANN001, ANN003, ANN201
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = dualkv.attention(*leaves, layout, **kw)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("d", [64, 128, 256, 512])
def test_race_out_dk_dv_bitwise(d: int, seed: int) -> None:
    """100 repeats: out, dk and dv are bitwise equal in the default mode (dk/dv need no atomics),
    and dq too in deterministic mode."""
    rng = random.Random(seed)
    layout = dualkv.Layout(*random_layout_lens(rng, groups=3, max_p=700, max_r=300), device="cuda")
    q, k, v, dout = inputs(layout, 8, 2, d, seed)
    first = fwd_bwd(q, k, v, dout, layout)
    first_det = fwd_bwd(q, k, v, dout, layout, deterministic=True)
    for _ in range(100):
        out, _, dk, dv = fwd_bwd(q, k, v, dout, layout)
        assert torch.equal(out, first[0]) and torch.equal(dk, first[2])
        assert torch.equal(dv, first[3])
    for _ in range(20):
        assert all(
            torch.equal(a, b)
            for a, b in zip(fwd_bwd(q, k, v, dout, layout, deterministic=True), first_det)
        )


def test_cuda_graph_capture(seed: int) -> None:
    layout = dualkv.Layout([300, 129], [[64, 1, 200], [0, 77]], device="cuda")
    q, k, v, dout = inputs(layout, 8, 2, 128, seed)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    eager = fwd_bwd(q, k, v, dout, layout, window=100)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the side stream, as graph capture requires
        for _ in range(2):
            for t in leaves:
                t.grad = None
            dualkv.attention(*leaves, layout, window=100).backward(dout)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    for t in leaves:
        t.grad = None
    with torch.cuda.graph(graph):
        out = dualkv.attention(*leaves, layout, window=100)
        out.backward(dout)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager[0])
    for t, g in zip(leaves, eager[1:]):
        torch.testing.assert_close(t.grad, g, rtol=0, atol=1e-2)


def test_no_host_sync(seed: int) -> None:
    layout = dualkv.Layout([256], [[128] * 4], device="cuda")
    q, k, v, dout = inputs(layout, 8, 8, 64, seed)
    fwd_bwd(q, k, v, dout, layout)  # warm-up (allocations)
    torch.cuda.set_sync_debug_mode("error")
    try:
        fwd_bwd(q, k, v, dout, layout)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_views_the_kernels_cannot_read_in_place(seed: int) -> None:
    """Tensors torch calls contiguous that the kernels cannot read in place: a view starting off
    a 16-byte boundary (q, and the incoming gradient), a single kv head with head stride 1. They
    are copied (they used to be refused as misaligned): the results are the dense inputs'."""
    rng = random.Random(seed)
    layout = dualkv.Layout(*random_layout_lens(rng, groups=2, max_p=300, max_r=200), device="cuda")
    q, k, v, dout = inputs(layout, 4, 1, 128, seed)
    want = fwd_bwd(q, k, v, dout, layout, deterministic=True)

    def off_by_one(t: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(t.numel() + 1, device="cuda", dtype=t.dtype)
        view = buf[1:].view_as(t)
        view.copy_(t)
        assert view.is_contiguous() and view.data_ptr() % 16 != 0
        return view

    k_unit = k.as_strided(k.shape, (k.shape[2], 1, 1))  # [T, 1, D], the same memory
    assert k_unit.is_contiguous() and k_unit.stride(1) == 1
    got = fwd_bwd(off_by_one(q), k_unit, v, off_by_one(dout), layout, deterministic=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # the op itself: every tensor on q's device
    leaves = [t.detach() for t in (q, k, v)]
    out, lse = dualkv._ops.ops.fwd(
        *leaves, layout.segments, layout.query_tiles, layout.key_tiles, layout.total_tokens,
        128**-0.5, None, 0.0, False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="q's device"):
        dualkv._ops.ops.bwd(
            dout.cpu(), *leaves, out, lse, None, layout.segments, layout.query_tiles,
            layout.key_tiles, layout.total_tokens, 128**-0.5, None, 0.0, False,
        )  # fmt: skip


def test_unsupported_on_gpu() -> None:
    layout = dualkv.Layout([8], [[4]], device="cuda")
    T = layout.total_tokens
    q = torch.randn(T, 4, 96, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dim 96"):
        dualkv.attention(q, q[:, :2], q[:, :2], layout)
    q = torch.randn(T, 4, 64, device="cuda", dtype=torch.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        dualkv.attention(q, q, q, layout)
    with pytest.raises(ValueError, match="layout is on cpu"):
        dualkv.attention(q.half(), q.half(), q.half(), dualkv.Layout([8], [[4]]))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_deterministic_runs_the_separate_dq_pass(
    d: int, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """deterministic=True leaves out every dQ that is added up by fp32 reductions (the default
    fused dQ at head dim 64/128 on sm_90a): its gradients are bitwise those of the separate dQ
    pass (DUALKV_FUSED_DQ=0; at head dim 256 the default), and bitwise equal over repeated runs.
    (On other GPUs every path is the separate pass: equal too.)"""
    rng = random.Random(seed)
    layout = dualkv.Layout(*random_layout_lens(rng, groups=3, max_p=700, max_r=300), device="cuda")
    q, k, v, dout = inputs(layout, 8, 2, d, seed)
    for name in ("DUALKV_FUSED_DQ", "DUALKV_FORCE_SM80"):
        monkeypatch.delenv(name, raising=False)
    if d <= 128:
        monkeypatch.setenv("DUALKV_FUSED_DQ", "0")
    separate = fwd_bwd(q, k, v, dout, layout)
    monkeypatch.delenv("DUALKV_FUSED_DQ", raising=False)
    for _ in range(10):
        det = fwd_bwd(q, k, v, dout, layout, deterministic=True)
        for a, b, what in zip(det, separate, ("out", "dq", "dk", "dv")):
            assert torch.equal(a, b), f"{what} differs from the separate dQ pass's"


def test_switch_values_not_accepted_warn(
    seed: int, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A switch value that is not one of its settings, and a removed switch, warn on stderr (the
    CUDA library's, once per message) and run the default path; the value carries the seed so
    that the message is new to this process."""
    layout = dualkv.Layout([300], [[64, 129]], device="cuda")
    q, k, v, dout = inputs(layout, 8, 2, 128, seed)
    for name in ("DUALKV_FUSED_DQ", "DUALKV_FORCE_SM80"):
        monkeypatch.delenv(name, raising=False)
    default = fwd_bwd(q, k, v, dout, layout)
    capfd.readouterr()
    monkeypatch.setenv("DUALKV_FUSED_DQ", f"false{seed}")
    monkeypatch.setenv("DUALKV_ATOMIC_DQ", f"{seed % 5}")
    again = fwd_bwd(q, k, v, dout, layout)
    torch.cuda.synchronize()
    err = capfd.readouterr().err
    assert f"dualkv: ignoring DUALKV_FUSED_DQ='false{seed}' (accepted: 0 or 1" in err, err
    assert f"dualkv: DUALKV_ATOMIC_DQ={seed % 5} was removed and is ignored" in err, err
    assert torch.equal(again[0], default[0]) and torch.equal(again[2], default[2])
