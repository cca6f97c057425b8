#!/usr/bin/env bash
# One device call for D = 512's small shared-memory sm_80 configs (FwdCfg / BwdCfg / DqCfg<512,
# true>: what A100/A800 and sm_86/89 GPUs run) on an H200, through DUALKV_SM80_SMALL_SMEM=1
# (--path sm80-d512-small, which implies the sm_80 path):
#   1. the D = 512 matrix + race 5 (bitwise repeats, deterministic mode bitwise) on that path;
#   2. 4 rounds of random layouts at D = 512 on it;
#   3. the regular sm_80 path, quick (it must still pick the regular configs on a 227 KB GPU);
#   4. compute-sanitizer racecheck (the exchange reuses the other stage's buffer) on the quick
#      matrix without its race case, and memcheck on --small, that path;
#   5. the bench at Gemma-4-31B's global-layer shape on default, sm80 and sm80-d512-small.
# Built here with head dim 512 only (the other head dims' cases are skipped) for sm_90a; logs in
# $OUT (test.log, summary.txt, bench.log). Every step has a timeout and the script a deadline.
#   OUT=... BUDGET=540 bash tests/cuda/d512small_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.out/d512small}"
mkdir -p "$OUT"
source tests/cuda/run_lib.sh
budget 540
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
step build 200 || exit 1
build_bin . build/d512small 512 300 || exit 1
: >"$OUT/test.log"
: >"$OUT/summary.txt"
check "sm80-d512-small, matrix, race 5" 150 --path sm80-d512-small --race 5
check "sm80-d512-small, random 4" 90 --path sm80-d512-small --random 4 --race 0
check "sm80, quick, race 3" 60 --path sm80 --quick --race 3
if step "racecheck: sm80-d512-small" 60; then
  # the quick matrix without the race case (with it, racecheck outruns 140 s at D = 512)
  timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 $BIN --quick --race 0 \
    --seed 1 --path sm80-d512-small >"$OUT/one.log" 2>&1
  rc=$?
  cat "$OUT/one.log" >>"$OUT/test.log"
  echo "racecheck sm80-d512-small: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/one.log" |
    tail -1), rc=$rc" | tee -a "$OUT/summary.txt"
  [ $rc = 0 ] || status=1
fi
memcheck sm80-d512-small sm80-d512-small 90
if step "bench (D = 512: default, sm80, sm80-d512-small)" 40; then
  timeout 120 $BIN --no-check --bench --bench-reps 5 --path default,sm80,sm80-d512-small \
    --shape 16,8192,1024,32,4,512 >"$OUT/bench.log" 2>&1
  echo "bench rc=$?"
fi
rm -f "$OUT/one.log"
echo "done after $(($(date +%s) - START)) s, status $status"
cat "$OUT/summary.txt"
grep "^|" "$OUT/bench.log" 2>/dev/null
exit $status
