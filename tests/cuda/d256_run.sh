#!/usr/bin/env bash
# Head dim 256, one device call for the warp-specialised D = 256 backward (sm90/sm90_bwd256_ws.cuh:
# its dK/dV kernel + the warp-specialised dQ pass). The binary is
# built on the dev machine (DUALKV_CUDA_HEAD_DIMS=256, sm_90a, static CUDA runtime) and carried in
# .out/ (libgomp in .out/lib); without it the script builds it first (-j16, ~2 min).
#   OUT=... bash tests/cuda/d256_run.sh
# Steps (a hang, timeout rc 124, in the matrix skips the rest): the D = 256 matrix + race 20
# (100 s), compute-sanitizer memcheck on --small (50 s), the bench at two shapes (40 s), ncu
# durations of the backward kernels (50 s). Four files under $OUT; a short table last.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.out/d256}"
mkdir -p "$OUT"
ldconfig -p | grep -q libgomp.so.1 || export LD_LIBRARY_PATH="$PWD/.out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
BIN=.out/dualkv_cuda_test
if [ ! -x "$BIN" ]; then
  echo "== build (no carried binary) =="
  cmake -S . -B build/d256 -G Ninja -DDUALKV_BUILD_TORCH=OFF -DDUALKV_BUILD_TESTS=ON \
    -DDUALKV_CUDA=ON -DDUALKV_CUDA_STATIC_RUNTIME=ON -DDUALKV_CUDA_HEAD_DIMS=256 \
    -DDUALKV_CUDA_ARCHS=90a >/dev/null && cmake --build build/d256 -j16 --target dualkv_cuda_test \
    >/dev/null && mkdir -p .out && cp build/d256/tests/cuda/dualkv_cuda_test .out/ ||
    { echo "FAIL: build"; exit 1; }
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
date -u
status=0
PATHS=default
SHAPES=(--shape 16,8192,1024,16,8,256 --shape 8,16384,2048,16,8,256)
declare -A res

echo "== standalone: D = 256 matrix + race 20, paths $PATHS =="
timeout 100 $BIN --race 20 --path "$PATHS" >"$OUT/test.log" 2>&1; rc=$?
grep -E "FAIL|error|reproduce" "$OUT/test.log" | grep -v "expected error" | head -20
tail -2 "$OUT/test.log"
grep -q "kernels cannot run" "$OUT/test.log" && { echo "FAIL: fell back"; rc=1; }
echo "rc=$rc"; [ $rc = 0 ] || status=1
res[test]="rc=$rc, $(grep -c ' ok$' "$OUT/test.log") ok, $(grep -c 'FAIL' "$OUT/test.log") FAIL"
if [ $rc = 124 ]; then
  echo "matrix timed out (a hang?): the remaining steps are skipped"
else
  echo "== compute-sanitizer memcheck (--small, default path) =="
  timeout 50 compute-sanitizer --tool memcheck --error-exitcode 9 $BIN --small --seed 1 \
    --path default >"$OUT/memcheck.log" 2>&1; rc=$?
  grep -E "ERROR SUMMARY|correctness" "$OUT/memcheck.log" | tail -2; echo "rc=$rc"
  [ $rc = 0 ] || status=1
  res[memcheck]="rc=$rc, $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)"

  echo "== bench: $PATHS, one process =="
  timeout 40 $BIN --no-check --bench --bench-reps 5 --path "$PATHS" \
    "${SHAPES[@]}" >"$OUT/bench.log" 2>&1; rc=$?
  echo "rc=$rc"; [ $rc = 0 ] || status=1

  echo "== ncu backward kernel durations (first shape, $PATHS) =="
  timeout 50 ncu --clock-control none \
    --metrics gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
    -k "regex:dkdv|dq_kernel|dq_ws_kernel|bwd_pre" $BIN --no-check --bench --bench-reps 1 \
    --path "$PATHS" --shape 16,8192,1024,16,8,256 >"$OUT/ncu.log" 2>&1
  rc=$?; echo "rc=$rc"
  for k in dkdv_ws256_kernel_sm90 dq_ws_kernel_sm90; do
    grep -q "$k" "$OUT/ncu.log" || { echo "FAIL: no $k kernel in the ncu log"; status=1; }
  done
fi

echo
echo "== summary =="
echo "matrix + race 20: ${res[test]:-not run}"
echo "memcheck: ${res[memcheck]:-not run}"
echo "-- bench (ms, useful TF/s): layout | fwd | bwd | fwd+bwd | bwd det. | fwd+bwd det."
[ -f "$OUT/bench.log" ] && grep "^| " "$OUT/bench.log" | grep -v "^| layout" | cut -d"|" -f2-7
echo "-- ncu (first shape; mean over launches): kernel | launches | ms | tensor pipe %"
# Grouped by kernel.
[ -f "$OUT/ncu.log" ] && awk '
  /^  (void )?[a-z_]+.*\(/ {n=$0; sub(/^  (void )?/,"",n); sub(/\(.*/,"",n)}
  /gpu__time_duration/ {u=$(NF-1); v=$NF; gsub(/,/,"",v)
    t=(u~/^(ms|msecond)$/)?v:(u~/^(us|usecond)$/)?v/1000:(u~/^(ns|nsecond)$/)?v/1e6:v*1000
    T[n]+=t; C[n]++; if (!(n in O)) {O[n]=++k; N[k]=n}}
  /pipe_tensor_op_hmma/ {H[n]+=$NF}
  END {for (i=1;i<=k;i++) {n=N[i]; printf "%s | %d | %.3f | %.1f\n", n, C[n], T[n]/C[n], H[n]/C[n]}}' \
  "$OUT/ncu.log"
exit $status
