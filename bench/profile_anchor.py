"""One forward + backward of a bench/attention.py method on plain causal attention (one sequence
of P tokens), after warm-up (FA4 compiles its kernels on the first call), inside a CUDA profiler
range: what `ncu --profile-from-start off` profiles (bench/profile_anchor.sh). The same runner,
inputs and output gradient as the benchmark's timed forward+backward.

    python bench/profile_anchor.py --method fa4-rows --shape 8192,16,8,128

Exit status 3 when the method is skipped here (its package is missing or it does not take the
head dim; the reason is printed).
"""

from __future__ import annotations

import argparse
import sys

import attention as ba
import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--method", required=True, help=f"one of {ba.METHODS + ba.EXTRA_METHODS}")
    ap.add_argument("--shape", required=True, metavar="P,Hq,Hkv,D")
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    p, hq, hkv, d = (int(x) for x in args.shape.split(","))
    c = ba.Case([(p, [0])], hq, hkv, d)
    try:
        run = ba.make_runner(args.method, c)
    except ba.Skip as e:
        print(f"{args.method}: skipped: {e}")
        return 3
    for _ in range(args.warmup):
        run.forward_backward()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run.forward_backward()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"profiled {args.method}: plain causal P={p} Hq={hq} Hkv={hkv} D={d}, forward+backward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
