#!/usr/bin/env bash
# One device call that checks the kernel defaults of issue 19 items 1-2 (fused dQ at D = 64/128
# unless deterministic, the wgmma D = 512 backward, no synchronous sm_90 forward) on every
# path there was then (the D = 256 / D = 512 variant paths added since: variants_run.sh), then
# times them side by side:
#   1. the full matrix + race 10 on the default path (every built head dim: fused dQ, and the
#      deterministic mode's separate pass, bitwise);
#   2. the bench at the reference shapes on every path (bwd and bwd-deterministic columns; the
#      table is printed last);
#   3. the quick matrix + race on the A/B paths sm90-sepdq (DUALKV_FUSED_DQ=0), sm90-d512-sm80
#      (DUALKV_SM90_D512_BWD=0) and sm80 (DUALKV_FORCE_SM80=1);
#   4. compute-sanitizer memcheck on small cases, default path.
# The binary: .out/dualkv_cuda_test if present (built on the dev machine with all head dims,
# -DDUALKV_CUDA_ARCHS=90a -DDUALKV_CUDA_STATIC_RUNTIME=ON; libgomp in .out/lib), else built here.
# Every step has a timeout and the script a deadline (BUDGET seconds). Logs: $OUT (4 files).
#   OUT=... BUDGET=330 bash tests/cuda/defaults_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.out/defaults}"
mkdir -p "$OUT"
source tests/cuda/run_lib.sh
budget 330
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
use_carried_libgomp
BIN=.out/dualkv_cuda_test
if ! $BIN --no-check >/dev/null 2>&1; then
  step build 200 || exit 1
  build_bin . build/dev "64;128;256;512" 300 || exit 1
fi
: >"$OUT/test.log"
: >"$OUT/summary.txt"
check "default, full matrix, race 10" 150 --path default --race 10
if step "bench (every path, reference shapes)" 60; then
  timeout 170 $BIN --no-check --bench --bench-reps 5 >"$OUT/bench.log" 2>&1
  echo "bench rc=$?"
fi
check "sm90-sepdq, quick, race 10" 60 --path sm90-sepdq --quick --race 10
check "sm90-d512-sm80, quick, race 3" 60 --path sm90-d512-sm80 --quick --race 3
check "sm80, quick, race 3" 60 --path sm80 --quick --race 3
memcheck default default 120
rm -f "$OUT/one.log"
echo "done after $(($(date +%s) - START)) s, status $status"
cat "$OUT/summary.txt"
grep "^|" "$OUT/bench.log" 2>/dev/null
exit $status
