"""Tree packing's minimum shared length, by measurement (issue 33).

``dualkv.pack(..., tree=True, min_shared=m)`` splits off a shared segment only when it holds at
least ``m`` tokens: a shorter one is repeated in each branch below it. A split saves its tokens'
repeated work (in every layer) but ends a segment, so a 128-token tile ends early and the
descendants' queries walk one more ancestor region. ``DEFAULT_MIN_SHARED`` (tree_packing.py)
is chosen from this sweep: the same batch packed with each ``m`` of ``--values`` and timed.

The batch (bench/trees.py ``short_prefix_batch``): GRPO groups, each a 1-3K prompt and
``--responses`` responses that first split into clusters sharing a short beginning (2-48 tokens),
some of a cluster sharing a further 16-256 tokens, then 300-1500 tokens each.

Per ``m``: the forest (segments, packed tokens T, rho), then
  attention  DualKV's attention forward+backward on that layout, random q/k/v, for each of
             ``--heads`` (median time; CUDA events on the GPU);
  model      the Qwen3 model step of bench/model_step.py's ``dualkv`` path (pack + forward +
             log-probs + loss + backward, gradient checkpointing), median step time.
The fastest ``m`` (and how flat the curve is around it) is the default to take.

    python bench/min_shared.py                                 # attention + 1.7B step, ~2.5 min
    python bench/min_shared.py --parts attention --groups 8    # attention only, a larger batch
    python bench/min_shared.py --device cpu --preset tiny --scale 0.05 --heads 4,2,32 \\
        --values 1,4,16 --warmup 0 --repeats 1                 # a smoke run on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from trees import short_prefix_batch

import dualkv

VALUES = (1, 16, 32, 64, 128, 256)
HEADS = ("16,8,128", "32,8,128")  # Qwen3-1.7B's, and the attention benchmark's packed shapes'


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall time of ``fn`` in ms (the GPU synchronised around each call)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def attention_ms(layout: dualkv.Layout, heads: tuple[int, int, int], device: torch.device,
                 dtype: torch.dtype, warmup: int, repeats: int) -> float:  # fmt: skip
    """DualKV's forward+backward on ``layout`` (fresh gradients each call)."""
    hq, hkv, d = heads
    t = layout.total_tokens
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(t, h, d, device=device, dtype=dtype, generator=g).requires_grad_()
               for h in (hq, hkv, hkv))  # fmt: skip
    dout = torch.randn(t, hq, d, device=device, dtype=dtype, generator=g)

    def fwd_bwd() -> None:
        for x in (q, k, v):
            x.grad = None
        out = dualkv.attention(q, k, v, layout)
        assert isinstance(out, torch.Tensor)
        out.backward(dout)

    return median_ms(fwd_bwd, device, warmup, repeats)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--values", default=",".join(map(str, VALUES)), help="min_shared values")
    ap.add_argument("--parts", default="attention,model", help="attention and/or model")
    ap.add_argument("--heads", nargs="+", default=list(HEADS), metavar="Hq,Hkv,D")
    ap.add_argument("--preset", default="1.7b", help="Qwen3 shape of the model step")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--responses", type=int, default=16)
    ap.add_argument("--scale", type=float, default=1.0, help="scale every length (smoke runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    args = ap.parse_args(argv)
    values = [int(x) for x in args.values.split(",")]
    if any(m < 1 for m in values):
        ap.error("--values: min_shared must be >= 1")
    parts = set(args.parts.split(","))
    if not parts or parts - {"attention", "model"}:
        ap.error("--parts: attention and/or model")
    heads: list[tuple[int, int, int]] = []
    for h in args.heads:
        parts_h = h.split(",")
        if len(parts_h) != 3 or not all(x.isdigit() for x in parts_h):
            ap.error(f"--heads takes Hq,Hkv,D, got {h!r}")
        heads.append((int(parts_h[0]), int(parts_h[1]), int(parts_h[2])))
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    import model_step as ms

    model: Any = None
    if "model" in parts:
        model = ms.build_any(args.preset, device, dtype)
        model.train()
        ms.checkpointing_for(model, "dualkv")
    vocab = model.config.vocab_size if model is not None else 151936
    tree = short_prefix_batch(args.groups, args.responses, args.seed, args.scale)
    print(tree.describe(), flush=True)
    ids, mask, gid, adv, p = ms.make_tree_rows(tree, vocab, device, seed=args.seed)
    old = torch.zeros(ids.shape[0], ids.shape[1] - p, device=device)
    rows = []
    for m in values:
        packed = dualkv.pack(ids, mask, p, tree=True, min_shared=m)
        layout = packed.layout
        rec: dict[str, Any] = dict(
            min_shared=m, segments=len(layout.lengths), packed_tokens=layout.total_tokens,
            rho=int(mask.sum()) / layout.total_tokens,
        )  # fmt: skip
        if "attention" in parts:
            for h in heads:
                key = "attention_ms_" + "_".join(map(str, h))
                rec[key] = attention_ms(layout, h, device, dtype, args.warmup, args.repeats)
        if "model" in parts:
            ms.OPTIONS.update(tree=True, min_shared=m)
            res = ms.bench_path(model, "dualkv", ids, mask, gid, adv, p, old, args.warmup,
                                args.repeats, device)  # fmt: skip
            rec["model_step_s"] = res.get("time", res.get("error"))
        print(json.dumps(rec), flush=True)
        rows.append(rec)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "min_shared.json"), "w") as f:
        json.dump(dict(batch=tree.describe(), device=str(device), rows=rows), f, indent=1)
    cols = [k for k in rows[0] if k not in ("min_shared", "segments", "packed_tokens", "rho")]
    print("\n| min_shared | segments | packed T | rho | " + " | ".join(cols) + " |")
    print("|---" * (4 + len(cols)) + "|")
    for rec in rows:
        cells = [f"{rec[k]:.3f}" if isinstance(rec[k], float) else str(rec[k]) for k in cols]
        print(f"| {rec['min_shared']} | {rec['segments']} | {rec['packed_tokens']} | "
              f"{rec['rho']:.2f} | " + " | ".join(cells) + " |")  # fmt: skip
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
