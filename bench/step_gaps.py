"""Where a model step's time goes on the GPU: one profiled step per path, kernel time vs idle.

For each path of ``bench/model_step.py`` (same model, batch and checkpointing), after warm-up
steps: one step under torch.profiler, then from its trace the kernel span, the time the GPU was
busy (union of kernels and copies) and its idle gaps, the largest listed with the CPU ops that
were running meanwhile. Busy time compares paths without the host's share of the wall time.

    python bench/step_gaps.py flex dualkv                      # compiled layers, 1.7B, 16,8192,1024
    python bench/step_gaps.py --eager --shape 8,16384,2048 dualkv
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import model_step as ms  # noqa: E402

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
CPU_CATS = ("cpu_op", "python_function", "cuda_runtime", "user_annotation")


def trace_events(prof: Any) -> list[dict[str, Any]]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as g:
            return json.load(g)["traceEvents"]


def report(path: str, label: str, wall: float, events: list[dict[str, Any]], top: int) -> None:
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    cpu = [e for e in events if e.get("cat") in CPU_CATS and "dur" in e]
    if not gpu:
        print(f"== {path}: no GPU activity in the trace")
        return
    first, end, busy = gpu[0]["ts"], gpu[0]["ts"], 0.0
    gaps: list[tuple[float, float, str]] = []  # (length, start, next kernel), microseconds
    for e in gpu:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, end, e["name"]))
        busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))
        end = max(end, e["ts"] + e["dur"])
    big = [g for g in gaps if g[0] > 50]
    print(f"== {path} ({label}): wall {wall * 1e3:.1f} ms (profiled), kernel span "
          f"{(end - first) / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms, idle gaps > 50 us: "
          f"{sum(g[0] for g in big) / 1e3:.1f} ms in {len(big)}")  # fmt: skip
    for length, start, nxt in sorted(gaps, reverse=True)[:top]:
        mid = start + length / 2
        around = sorted((e for e in cpu if e["ts"] <= mid <= e["ts"] + e["dur"]),
                        key=lambda e: e["dur"])  # fmt: skip
        names = " < ".join(e["name"][:50] for e in around[:4])
        print(f"  gap {length / 1e3:7.2f} ms at +{(start - first) / 1e3:7.1f} ms before "
              f"{nxt[:40]!r}; CPU: {names}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("paths", nargs="*", default=["flex", "dualkv"], help=f"of {ms.ALL_PATHS}")
    ap.add_argument("--preset", default="1.7b")
    ap.add_argument("--shape", default="16,8192,1024", help="N,P,R")
    ap.add_argument("--eager", action="store_true", help="do not compile the decoder layers")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=12, help="gaps listed per path")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the report is about kernel time)")
    dev = torch.device("cuda")
    model = ms.build_model(args.preset, dev, torch.bfloat16)
    model.train()
    if not args.eager:
        ms.compile_layers(model)
    n, p, r = (int(x) for x in args.shape.split(","))
    ids, mask, gid, adv = ms.make_rows(n, p, r, model.config.vocab_size, dev, seed=n + p + r)
    old = torch.zeros(n, r, device=dev)
    for path in args.paths:
        ms.checkpointing_for(model, path)
        for _ in range(args.warmup):
            model.zero_grad(set_to_none=True)
            ms.step(model, path, ids, mask, gid, adv, p, old)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        prof = ms.profiled_step(model, path, ids, mask, gid, adv, p, old)
        wall = time.perf_counter() - t0
        label = f"Qwen3-{args.preset}, {args.shape}, {'eager' if args.eager else 'compiled'}"
        report(path, label, wall, trace_events(prof), args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
