"""Attention-level demo: a random multi-group layout through DualKV and through the unshared
reference rows; prints the token reduction rho, the max error and the timings.

    python -m dualkv.demos.attention                # tiny default, CPU
    python -m dualkv.demos.attention --device cuda --groups 2 --prompt 8192 --responses 16 \\
        --response-len 1024 --heads 32 --kv-heads 8 --head-dim 128
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable

import torch

import dualkv
from dualkv.reference import unshared_attention


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time in ms (device-synchronised)."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    """Runs the demo; see ``--help``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=384, help="mean prompt length P")
    ap.add_argument("--responses", type=int, default=8, help="responses per group N")
    ap.add_argument("--response-len", type=int, default=96, help="mean response length R")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rng = random.Random(args.seed)
    prefix = [max(0, int(args.prompt * rng.uniform(0.5, 1.5))) for _ in range(args.groups)]
    resp = [
        [max(0, int(args.response_len * rng.uniform(0.25, 1.75))) for _ in range(args.responses)]
        for _ in range(args.groups)
    ]
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    layout = dualkv.Layout(prefix, resp, device=device)
    T, hq, hkv, d = layout.total_tokens, args.heads, args.kv_heads, args.head_dim
    gen = torch.Generator().manual_seed(args.seed)
    q, k, v = (
        torch.randn(T, h, d, generator=gen).to(device, dtype).requires_grad_()
        for h in (hq, hkv, hkv)
    )
    dout = torch.randn(T, hq, d, generator=gen).to(device, dtype)
    scale = 1.0 / math.sqrt(d)

    def dualkv_step() -> torch.Tensor:
        out = dualkv.attention(q, k, v, layout, window=args.window)
        assert isinstance(out, torch.Tensor)  # no lse asked for
        torch.autograd.grad(out, (q, k, v), dout)
        return out

    def unshared_step() -> torch.Tensor:
        out, _ = unshared_attention(q, k, v, prefix, resp, scale, args.window)
        torch.autograd.grad(out, (q, k, v), dout)
        return out

    print(
        f"layout: {layout.num_groups} groups, {layout.num_responses} responses, "
        f"P={prefix}, mean R={sum(map(sum, resp)) / max(1, layout.num_responses):.0f}"
    )
    print(
        f"tokens: standard rows {layout.unshared_tokens}, packed {T}, "
        f"token reduction rho = {layout.token_reduction:.2f}"
    )
    out = dualkv.attention(q, k, v, layout, window=args.window)
    assert isinstance(out, torch.Tensor)  # no lse asked for
    q64, k64, v64 = (t.detach().double().cpu() for t in (q, k, v))
    exact, _ = unshared_attention(q64, k64, v64, prefix, resp, scale, args.window)
    plain, _ = unshared_attention(
        q.detach(), k.detach(), v.detach(), prefix, resp, scale, args.window
    )
    err = (out.detach().double().cpu() - exact).abs().max().item()
    err_plain = (plain.double().cpu() - exact).abs().max().item()
    print(
        f"max |out - fp64 unshared reference|: dualkv {err:.2e}, "
        f"plain {args.dtype} unshared rows {err_plain:.2e}"
    )
    t_dualkv = _timed(dualkv_step, device, args.repeats)
    t_rows = _timed(unshared_step, device, args.repeats)
    flops = layout.flops(d, hq, args.window) + layout.flops(d, hq, args.window, backward=True)
    print(
        f"fwd+bwd time: dualkv {t_dualkv:.1f} ms ({flops / t_dualkv / 1e9:.2f} TFLOP/s useful), "
        f"unshared rows (plain PyTorch) {t_rows:.1f} ms, speed-up {t_rows / t_dualkv:.1f}x"
    )


if __name__ == "__main__":
    main()
