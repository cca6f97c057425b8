#!/usr/bin/env bash
# A/B of the forward/backward parameter split (FwdParams / BwdParams): it moved the fields'
# offsets in the kernels' parameter bank, so their machine code changed (src/cuda/NOTES.md,
# "Kernel parameters"). The bench of both binaries on the default and sm80 paths (the sm_80
# dK/dV kernel was rescheduled), interleaved (old, new, old, new on the default path), and a
# table of old vs new per shape and path (best of the rounds), printed last. Correctness of the
# new binary: tests/cuda/defaults_run.sh (run it first, in the same call).
#   .out/dualkv_cuda_test       the new binary (this tree)
#   .out/dualkv_cuda_test.base  the binary before the split (same build options)
#   OUT=... BUDGET=330 bash tests/cuda/params_ab_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.out/params_ab}"
mkdir -p "$OUT"
source tests/cuda/run_lib.sh
budget 330
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
use_carried_libgomp
NEW=.out/dualkv_cuda_test
OLD=.out/dualkv_cuda_test.base
for b in $NEW $OLD; do $b --no-check >/dev/null 2>&1 || { echo "FAIL: $b does not run"; exit 1; }; done
status=0
: >"$OUT/bench.log"
for run in "old default" "new default" "old default" "new default" "old sm80" "new sm80"; do
  set -- $run
  bin=$NEW
  [ "$1" = old ] && bin=$OLD
  if step "bench ($1 binary, path $2)" 40; then
    timeout 120 $bin --no-check --bench --bench-reps 5 --path "$2" 2>&1 | grep "^bench " |
      sed "s/^bench /bench $1 /" >>"$OUT/bench.log"
  fi
done
echo "done after $(($(date +%s) - START)) s, status $status"
python3 - "$OUT/bench.log" <<'PY'
import re, sys
rows: dict[str, dict[str, list[tuple[float, float, float]]]] = {}
for line in open(sys.argv[1]):
    m = re.match(r"bench (old|new) (.*): fwd ([\d.]+) ms, bwd ([\d.]+) ms, bwd deterministic ([\d.]+)", line)
    if m:
        rows.setdefault(m[2], {}).setdefault(m[1], []).append((float(m[3]), float(m[4]), float(m[5])))
print("| path shape | fwd ms old / new | bwd ms old / new | bwd deterministic ms old / new |")
print("|---|---|---|---|")
for name, r in rows.items():
    best = {k: [min(x[i] for x in v) for i in range(3)] for k, v in r.items()}
    o, n = best.get("old", [float("nan")] * 3), best.get("new", [float("nan")] * 3)
    print(f"| {name} | " + " | ".join(f"{o[i]:.2f} / {n[i]:.2f}" for i in range(3)) + " |")
PY
exit $status
