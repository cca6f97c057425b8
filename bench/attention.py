"""Attention benchmark on the GPU: DualKV vs the ways a trainer runs shared-prompt attention today.

For each layout (N responses of R tokens sharing a prompt of P tokens, one group; or the
realistic micro-batch: several groups of different P, N and long-tailed R) it times the
forward and forward+backward of
  dualkv      DualKV on the packed layout (P + N*R tokens)
  sdpa_cudnn  PyTorch SDPA, cuDNN backend, causal, on the N unshared rows of P + R tokens
              (several groups: every group's rows, right-padded to the longest row)
  sdpa_fa2    PyTorch SDPA, FlashAttention-2 backend, same rows
  sdpa_mem    PyTorch SDPA, memory-efficient backend, same rows (the only one that takes D = 512)
  flex        FlexAttention on the packed layout with a shared-prefix block mask
  cudnn_3pass prompt causal + responses vs prompt + each response causal (cuDNN), merged by lse,
              exact backward (merged out and lse fed to each pass's backward; one group only)
  mem_3pass   the same composition with PyTorch's memory-efficient attention ops (D = 512)
and reports the median time (CUDA events) and useful TFLOP/s on the packed layout's FLOP count
(dualkv.Layout.flops: 4*D*Hq*allowed pairs forward, 2.5x that backward).

    python bench/attention.py                 # all reference shapes, all methods
    python bench/attention.py --shapes 0 --methods dualkv,flex --out bench/out
    python bench/attention.py --shape 16,8192,1024,16,8,128   # a shape of your own (Qwen3-1.7B)
    python bench/attention.py --multi 16,8,128                # the realistic micro-batch
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

import dualkv

# (N, P, R, Hq, Hkv, D): DESIGN.md's reference shapes; N = 0: the realistic micro-batch
# (`realistic_groups`) with those heads.
SHAPES = [
    (16, 8192, 1024, 32, 8, 128),
    (32, 4096, 2048, 32, 8, 128),
    (8, 16384, 2048, 32, 8, 128),
    (16, 2048, 2048, 16, 16, 64),
    (16, 4096, 1024, 16, 8, 256),
    (0, 0, 0, 32, 8, 128),
]
Groups = list[tuple[int, list[int]]]  # (prompt length, response lengths) per group


def realistic_groups(seed: int = 0) -> Groups:
    """A GRPO micro-batch as a trainer packs it: 4 groups with prompts of 1K, 2.5K, 4K and 6K
    tokens, 8-16 responses each, response lengths long-tailed (log-normal, median ~700, capped
    at 4K, at least 16), fixed by the seed so every run times the same layout."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for p in (1024, 2560, 4096, 6144):
        n = int(torch.randint(8, 17, (), generator=g))
        rs = torch.exp(6.5 + 0.9 * torch.randn(n, generator=g)).clamp(16, 4096)
        groups.append((p, [int(x) for x in rs]))
    return groups


METHODS = ["dualkv", "sdpa_cudnn", "sdpa_fa2", "flex", "cudnn_3pass"]
# Also available (not in the default list): sdpa_mem, mem_3pass.
EXTRA_METHODS = ["sdpa_mem", "mem_3pass"]


# GPU clock cycles of the spin queued before each timed call with --lead-spin (~1 ms at the
# H200's 1.98 GHz: longer than any method's host-side dispatch of one call here).
LEAD_SPIN_CYCLES = 2_000_000


def time_ms(fn: Callable[[], object], warmup: int, repeats: int, lead_spin: bool = False) -> float:
    """Median of `repeats` CUDA-event timings after `warmup` calls. Each timed call starts from
    an idle GPU (the previous one was synchronised), so the events include the host's latency to
    its first kernel; with `lead_spin` a spin kernel is queued first, so the host issues the call
    while the GPU spins and the events time the GPU's work alone."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead_spin:
            torch.cuda._sleep(LEAD_SPIN_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class Case:
    """Packed and row-layout inputs of one layout (bf16, random): `groups` of (P, [R_1..R_N])."""

    def __init__(self, groups: Groups, hq: int, hkv: int, d: int) -> None:
        self.groups, self.hq, self.hkv, self.d = groups, hq, hkv, d
        # one group of equal responses: the shape the single-group methods (3-pass) take
        (self.p, rs), *rest = groups
        self.n, self.r = len(rs), rs[0] if rs else 0
        self.single = not rest and all(x == self.r for x in rs)
        self.layout = dualkv.Layout([p for p, _ in groups], [r for _, r in groups], device="cuda")
        T = self.layout.total_tokens
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda h: torch.randn(T, h, d, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        self.q, self.k, self.v = mk(hq), mk(hkv), mk(hkv)
        self.dout = mk(hq)
        self.scale = 1.0 / math.sqrt(d)
        self.flops_fwd = self.layout.flops(d, hq)
        self.flops_bwd = self.layout.flops(d, hq, backward=True)
        # Unshared rows [rows, H, L, D] (the standard layout, right-padded to the longest row
        # with token 0: causal attention never lets a real query see a padded key), K/V
        # expanded for SDPA; `source`: the (row, position) each packed token is read back from.
        rows, source, start = [], [], 0
        for p, rs in groups:
            prompt = torch.arange(start, start + p)
            start += p
            for i, r in enumerate(rs):
                rows.append(torch.cat([prompt, torch.arange(start, start + r)]))
                if i == 0:
                    source += [(len(rows) - 1, j) for j in range(p)]
                source += [(len(rows) - 1, p + j) for j in range(r)]
                start += r
        length = max(len(x) for x in rows)
        idx = torch.stack([torch.cat([x, x.new_zeros(length - len(x))]) for x in rows]).cuda()
        src = torch.tensor(source)
        self.rows_source = (src[:, 0] * length + src[:, 1]).cuda()  # into [rows * L]
        rows_of = lambda t: t[idx].transpose(1, 2).contiguous()  # noqa: E731
        self.rows_q = rows_of(self.q)
        self.rows_k = rows_of(self.k.repeat_interleave(hq // hkv, 1))
        self.rows_v = rows_of(self.v.repeat_interleave(hq // hkv, 1))
        self.rows_dout = rows_of(self.dout)

    def leaves(self, *ts: torch.Tensor) -> list[torch.Tensor]:
        return [t.detach().requires_grad_() for t in ts]


# Each runner returns (forward, forward+backward, forward output in packed [T, Hq, D] order).
Runner = tuple[Callable[[], object], Callable[[], object], Callable[[], torch.Tensor]]


def fresh_backward(leaves: list[torch.Tensor], out: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward into cleared gradients, as flash-attn's benchmarks do: in a model q, k, v are
    activations, so no step adds its gradients into existing ones (accumulating into the
    leaves' .grad would time an elementwise add per input, 2-4% of DualKV's time at D = 64)."""
    for t in leaves:
        t.grad = None
    torch.autograd.backward(out, grad)


def run_dualkv(c: Case) -> Runner:
    q, k, v = c.leaves(c.q, c.k, c.v)
    fwd = lambda: dualkv.attention(q, k, v, c.layout)  # noqa: E731
    return fwd, lambda: fresh_backward([q, k, v], fwd(), c.dout), fwd


def run_sdpa(c: Case, backend: torch.nn.attention.SDPBackend) -> Runner:
    q, k, v = c.leaves(c.rows_q, c.rows_k, c.rows_v)

    def fwd() -> torch.Tensor:
        with torch.nn.attention.sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def packed_out() -> torch.Tensor:
        rows = fwd().transpose(1, 2)  # [rows, L, H, D]
        return rows.reshape(-1, c.hq, c.d)[c.rows_source]

    return fwd, lambda: fresh_backward([q, k, v], fwd(), c.rows_dout), packed_out


def run_flex(c: Case) -> Runner:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    pos = c.layout.position_ids
    # Per token: its group, and its segment (0 for the prompt, i + 1 for response i).
    group, seg = [], []
    for gi, (p, rs) in enumerate(c.groups):
        group += [gi] * (p + sum(rs))
        seg += [0] * p + [i + 1 for i, r in enumerate(rs) for _ in range(r)]
    grp, seg_t = (torch.tensor(x, device="cuda") for x in (group, seg))

    def mask_mod(b, h, qi, ki):  # noqa: ANN001, ANN202
        same = (grp[ki] == grp[qi]) & ((seg_t[ki] == 0) | (seg_t[ki] == seg_t[qi]))
        return same & (pos[ki] <= pos[qi])

    # A graph per shape and grad mode (the forward runs under no_grad too): past dynamo's default
    # of 8 the later shapes would run the unfused flex_attention (out of memory at D = 256).
    from model_step import allow_recompiles

    allow_recompiles()
    T = c.layout.total_tokens
    block_mask = create_block_mask(mask_mod, 1, 1, T, T, device="cuda")
    flex = torch.compile(flex_attention, dynamic=False)
    q, k, v = c.leaves(*(t.transpose(0, 1)[None] for t in (c.q, c.k, c.v)))
    dout = c.dout.transpose(0, 1)[None]
    fwd = lambda: flex(q, k, v, block_mask=block_mask, scale=c.scale, enable_gqa=True)  # noqa: E731
    fb = lambda: fresh_backward([q, k, v], fwd(), dout)  # noqa: E731
    return fwd, fb, lambda: fwd()[0].transpose(0, 1)


def run_cudnn_3pass(c: Case, backend: str = "cudnn") -> Runner:
    """Three cuDNN (or memory-efficient, backend="mem") attention passes merged by lse; backward
    feeds the merged out/lse to each pass's backward. One group of equal responses only."""
    if not c.single:
        raise NotImplementedError("the 3-pass composition is timed on one group of equal R")
    aten = torch.ops.aten
    n, p, r, h = c.n, c.p, c.r, c.hq
    expand = lambda t: t.repeat_interleave(c.hq // c.hkv, 1)  # noqa: E731
    q, k, v, dout = (x.transpose(0, 1)[None] for x in (c.q, expand(c.k), expand(c.v), c.dout))
    # Views [1, H, L, D]: prompt, all responses; responses batched [N, H, R, D].
    qp, kp, vp = (x[:, :, :p] for x in (q, k, v))
    qr, kr, vr = (x[:, :, p:] for x in (q, k, v))
    batch = lambda x: x.reshape(h, n, r, -1).transpose(0, 1)  # noqa: E731
    unbatch = lambda x: x.transpose(0, 1).reshape(1, h, n * r, -1)  # noqa: E731
    passes = [  # (q, k, v, causal, to merged query order, back to pass order)
        (qp, kp, vp, True),
        (qr, kp, vp, False),
        (batch(qr.contiguous()), batch(kr.contiguous()), batch(vr.contiguous()), True),
    ]

    def cudnn(qq, kk, vv, causal):  # noqa: ANN001, ANN202
        if backend == "mem":
            return aten._scaled_dot_product_efficient_attention(
                qq, kk, vv, None, True, 0.0, causal, scale=c.scale
            )
        return aten._scaled_dot_product_cudnn_attention(
            qq, kk, vv, None, True, 0.0, causal, False, scale=c.scale
        )

    def lse_of(res: tuple) -> torch.Tensor:  # [B, H, L] whatever the trailing dims / padding
        if backend == "mem":  # [B, H, L rounded up]
            return res[1][..., : res[0].shape[2]]
        return res[1].reshape(res[0].shape[:3])

    def pass_backward(do, qq, kk, vv, o, lse_p, rr, causal):  # noqa: ANN001, ANN202
        if backend == "mem":
            lse_pad = F.pad(lse_p, (0, rr[1].shape[-1] - lse_p.shape[-1])).contiguous()
            return aten._scaled_dot_product_efficient_attention_backward(
                do,
                qq,
                kk,
                vv,
                None,
                o,
                lse_pad,
                rr[2],
                rr[3],
                0.0,
                [True, True, True, False],
                causal,
                scale=c.scale,
            )
        return aten._scaled_dot_product_cudnn_attention_backward(
            do,
            qq,
            kk,
            vv,
            o,
            lse_p.contiguous().view_as(rr[1]),
            rr[6],
            rr[7],
            None,  # attn_bias: undefined (no bias), as autograd passes it
            rr[2],
            rr[3],
            rr[4],
            rr[5],
            0.0,
            causal,
            scale=c.scale,
        )

    def forward() -> tuple[list, torch.Tensor, torch.Tensor]:
        res = [cudnn(*ps) for ps in passes]
        o_prompt, l_prompt = res[0][0], lse_of(res[0])
        o_a, l_a = res[1][0], lse_of(res[1])
        o_b, l_b = unbatch(res[2][0]), lse_of(res[2]).transpose(0, 1).reshape(1, h, n * r)
        l_resp = torch.logaddexp(l_a, l_b)
        o_resp = o_a * torch.exp(l_a - l_resp)[..., None] + o_b * torch.exp(l_b - l_resp)[..., None]
        out = torch.cat([o_prompt, o_resp.to(o_a.dtype)], dim=2)
        lse = torch.cat([l_prompt, l_resp], dim=2)
        return res, out, lse

    def backward() -> None:
        res, out, lse = forward()
        outs = [out[:, :, :p], out[:, :, p:], batch(out[:, :, p:].contiguous())]
        lses = [
            lse[:, :, :p],
            lse[:, :, p:],
            lse[:, :, p:].reshape(1, h, n, r).transpose(0, 1).reshape(n, h, r),
        ]
        douts = [dout[:, :, :p], dout[:, :, p:], batch(dout[:, :, p:].contiguous())]
        grads = []
        for (qq, kk, vv, causal), rr, o, lse_p, do in zip(passes, res, outs, lses, douts):
            grads.append(
                pass_backward(do.contiguous(), qq, kk, vv, o.contiguous(), lse_p, rr, causal)
            )
        # Assemble dq, dk, dv as autograd would: sum the passes' contributions.
        dq = torch.cat([grads[0][0], grads[1][0] + unbatch(grads[2][0])], dim=2)
        dk = torch.cat([grads[0][1] + grads[1][1], unbatch(grads[2][1])], dim=2)
        dv = torch.cat([grads[0][2] + grads[1][2], unbatch(grads[2][2])], dim=2)
        return dq, dk, dv

    def packed_out() -> torch.Tensor:
        return forward()[1][0].transpose(0, 1)

    return (lambda: forward()[1]), backward, packed_out


def make_runner(method: str, c: Case) -> Runner:
    sdpa = torch.nn.attention.SDPBackend
    if method == "dualkv":
        return run_dualkv(c)
    if method in ("sdpa_cudnn", "sdpa_fa2", "sdpa_mem"):
        backend = {
            "sdpa_cudnn": sdpa.CUDNN_ATTENTION,
            "sdpa_fa2": sdpa.FLASH_ATTENTION,
            "sdpa_mem": sdpa.EFFICIENT_ATTENTION,
        }[method]
        return run_sdpa(c, backend)
    if method == "flex":
        return run_flex(c)
    if method == "cudnn_3pass":
        return run_cudnn_3pass(c)
    if method == "mem_3pass":
        return run_cudnn_3pass(c, backend="mem")
    raise ValueError(f"unknown method {method!r}; choose from {METHODS + EXTRA_METHODS}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", default=",".join(str(i) for i in range(len(SHAPES))))
    ap.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="N,P,R,Hq,Hkv,D",
        help="a shape of your own (repeatable); replaces --shapes",
    )
    ap.add_argument(
        "--multi",
        action="append",
        default=[],
        metavar="Hq,Hkv,D",
        help="the realistic micro-batch (realistic_groups) with these heads (repeatable); "
        "replaces --shapes",
    )
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time the methods in turn this many times (every other round in reverse) and "
        "report the median of the rounds",
    )
    ap.add_argument(
        "--lead-spin",
        action="store_true",
        help="queue ~1 ms of GPU spin before each timed call, so that the events time the "
        "GPU's work without the host's launch latency (for every method alike)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    args = ap.parse_args()
    methods = args.methods.split(",")
    rows = []
    shapes = [tuple(int(x) for x in sh.split(",")) for sh in args.shape]
    if any(len(sh) != 6 for sh in shapes):
        ap.error("--shape takes six integers N,P,R,Hq,Hkv,D")
    multi = [tuple(int(x) for x in sh.split(",")) for sh in args.multi]
    if any(len(sh) != 3 for sh in multi):
        ap.error("--multi takes three integers Hq,Hkv,D")
    shapes += [(0, 0, 0, *sh) for sh in multi]
    shapes = shapes or [SHAPES[int(s)] for s in args.shapes.split(",")]
    for n, p, r, hq, hkv, d in shapes:
        groups = realistic_groups() if n == 0 else [(p, [r] * n)]
        c = Case(groups, hq, hkv, d)
        shape = f"N={n} P={p} R={r} Hq={hq} Hkv={hkv} D={d}"
        if n == 0:
            shape = f"multi T={c.layout.total_tokens} Hq={hq} Hkv={hkv} D={d}"
            per_group = [(p, len(rs), sum(rs), max(rs)) for p, rs in groups]
            print(f"{shape}: (P, N, sum R, max R) per group {per_group}")
        # The methods in turn, every other round in reverse (--rounds): a GPU's clocks follow its
        # recent load, so a method timed right after an idle moment or after a heavy one is not
        # timed like the others; each figure is the median over the rounds.
        reference = None  # the first method's output (DualKV's by default): all must agree with it
        times: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
        diffs: dict[str, float] = {}
        errors: dict[str, str] = {}
        for rnd in range(args.rounds):
            for m in methods if rnd % 2 == 0 else methods[::-1]:
                if m in errors:
                    continue
                try:
                    fwd, fb, packed_out = make_runner(m, c)
                    with torch.no_grad():
                        if rnd == 0:
                            out = packed_out().float()
                            reference = out if reference is None else reference
                            diffs[m] = (out - reference).abs().max().item()
                            del out
                        t_f = time_ms(fwd, args.warmup, args.repeats, args.lead_spin)
                    t_fb = time_ms(fb, args.warmup, args.repeats, args.lead_spin)
                    times[m].append((t_f, t_fb))
                except Exception as e:  # a baseline that cannot run this shape (e.g. out of memory)
                    errors[m] = f"{type(e).__name__}: {str(e)[:120]}"
                torch.cuda.empty_cache()
        for m in methods:
            if m in errors:
                rows.append(dict(shape=shape, method=m, error=errors[m]))
                continue
            t_f = statistics.median(t[0] for t in times[m])
            t_fb = statistics.median(t[1] for t in times[m])
            rows.append(
                dict(
                    shape=shape,
                    method=m,
                    fwd_ms=t_f,
                    fwd_bwd_ms=t_fb,
                    fwd_tflops=c.flops_fwd / t_f / 1e9,
                    fwd_bwd_tflops=(c.flops_fwd + c.flops_bwd) / t_fb / 1e9,
                    max_diff=diffs[m],
                    rounds=len(times[m]),
                )
            )
        del c
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "attention.json"), "w") as f:
        json.dump(
            dict(
                gpu=torch.cuda.get_device_name(),
                torch=torch.__version__,
                lead_spin=args.lead_spin,
                rows=rows,
            ),
            f,
            indent=1,
        )
    timing = "GPU time (--lead-spin)" if args.lead_spin else "host launch latency included"
    print(
        f"\nGPU {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, {timing}; "
        "TF/s = useful TFLOP/s on the packed layout's FLOP count"
    )
    head = ("shape", "method", "fwd ms", "fwd TF/s", "f+b ms", "f+b TF/s", "max|diff|")
    print("{:<38} {:<12} {:>8} {:>9} {:>8} {:>9} {:>9}".format(*head))
    for row in rows:
        if "error" in row:
            print(f"{row['shape']:<38} {row['method']:<12} {row['error']}")
        else:
            print(
                f"{row['shape']:<38} {row['method']:<12} {row['fwd_ms']:8.2f} "
                f"{row['fwd_tflops']:9.1f} {row['fwd_bwd_ms']:8.2f} {row['fwd_bwd_tflops']:9.1f} "
                f"{row['max_diff']:9.1e}"
            )
    try:
        plot(rows, os.path.join(args.out, "attention.png"))
    except ImportError:
        print("matplotlib not installed: no plot")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(methods)
    for mi, m in enumerate(methods):
        vals = [
            next(
                (r.get("fwd_bwd_tflops", 0) for r in rows if r["shape"] == s and r["method"] == m),
                0,
            )
            for s in shapes
        ]
        ax.bar([i + mi * width for i in range(len(shapes))], vals, width, label=m)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))])
    ax.set_xticklabels([s.replace(" Hq", "\nHq") for s in shapes], fontsize=7)
    ax.set_ylabel("useful TFLOP/s (fwd+bwd)")
    ax.set_title(f"Shared-prompt attention, {torch.cuda.get_device_name()}, bf16")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
