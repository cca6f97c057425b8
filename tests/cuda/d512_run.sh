#!/usr/bin/env bash
# Head dim 512, one device call: the standalone CUDA tests (binary built on the dev machine with
# DUALKV_CUDA_HEAD_DIMS=512, carried in .out/), sanitizers, the package built with D = 64 and 512
# and its D = 512 GPU tests on the default (wgmma backward on sm_90a), sm_80 and sm_80-backward
# paths, the benchmarks side by side, and ncu kernel durations. The sdpa step needs the package
# (pytest step) installed first.
#   OUT=... bash tests/cuda/d512_run.sh [test] [sanitize] [pytest] [bench] [sdpa] [ncu] [d512bwd] [fwd2]
# d512bwd: the wgmma D = 512 backward (the default on sm_90a) against the sm_80 one
# (DUALKV_SM90_D512_BWD=0, --path sm90-d512-sm80): the matrix + race of both, memcheck of the
# default, the backward timed on both, ncu kernel durations of the default.
# fwd2: the default path's D = 512 matrix + race 20 and memcheck on --small, then the D = 512
# cluster forward timed at both shapes and its ncu kernel durations. Under 4 minutes. (The bwd3
# step and fwd2's single-CTA forward went with the kernels they compared.)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.out/d512}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ldconfig -p | grep -q libgomp.so.1 || export LD_LIBRARY_PATH="$PWD/.out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
BIN=.out/dualkv_cuda_test
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(test sanitize pytest bench sdpa)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
date -u
status=0
SHAPES=(--shape 16,8192,1024,32,4,512 --shape 8,16384,2048,32,4,512)
# The default path's D = 512 matrix + race 20 and memcheck on --small (step fwd2: their
# kernels are the defaults), once per call; false after a hang (timeout, rc 124) in the matrix.
checked_default=""
check_default() {
  [ -n "$checked_default" ] && return "$checked_default"
  local rc
  echo "== standalone: D = 512 matrix + race 20, path default =="
  timeout 100 $BIN --race 20 --path default >"$OUT/default_test.log" 2>&1; rc=$?
  grep -E "FAIL|error|note|reproduce" "$OUT/default_test.log" | grep -v "expected error" | head -20
  tail -2 "$OUT/default_test.log"
  grep -q "kernels cannot run" "$OUT/default_test.log" && { echo "FAIL: fell back"; rc=1; }
  echo "rc=$rc"; [ $rc = 0 ] || status=1
  checked_default=0
  [ $rc = 124 ] && { checked_default=1; return 1; }
  echo "== compute-sanitizer memcheck (--small, path default) =="
  timeout 50 compute-sanitizer --tool memcheck --error-exitcode 9 $BIN --small --seed 1 \
    --path default >"$OUT/default_memcheck.log" 2>&1; rc=$?
  grep -E "ERROR SUMMARY|correctness" "$OUT/default_memcheck.log" | tail -2; echo "rc=$rc"
  [ $rc = 0 ] || status=1
  return 0
}
for s in "${steps[@]}"; do
  case "$s" in
  test)
    echo "== standalone: D = 512 matrix, every path, race 20 =="
    timeout 420 $BIN --race 20 >"$OUT/test.log" 2>&1; rc=$?
    grep -E "FAIL|error|note|reproduce" "$OUT/test.log" | head -20; tail -2 "$OUT/test.log"
    grep -q "kernels cannot run" "$OUT/test.log" && { echo "FAIL: fell back"; rc=1; }
    echo "rc=$rc"; [ $rc = 0 ] || status=1 ;;
  sanitize)
    for run in "memcheck default" "racecheck sm80"; do
      set -- $run
      echo "== compute-sanitizer $1 (--small, path $2) =="
      timeout 200 compute-sanitizer --tool "$1" --error-exitcode 9 $BIN --small --seed 1 \
        --path "$2" >"$OUT/san_$1.log" 2>&1; rc=$?
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|correctness" "$OUT/san_$1.log" | tail -2; echo "rc=$rc"
      [ $rc = 0 ] || status=1
    done ;;
  pytest)
    echo "== build the package (D = 64 and 512) =="
    CMAKE_ARGS="-DDUALKV_CUDA=ON -DDUALKV_CUDA_HEAD_DIMS=64;512" CMAKE_BUILD_PARALLEL_LEVEL=16 \
      timeout 300 python3 -m pip install --no-build-isolation --no-deps -q . >"$OUT/build.log" 2>&1 ||
      { tail -30 "$OUT/build.log"; exit 1; }
    for path in default DUALKV_FORCE_SM80=1 DUALKV_SM90_D512_BWD=0; do
      echo "== pytest D = 512 ($path) =="
      envs=(); [ "$path" = default ] || envs=("$path")
      (cd /tmp && env "${envs[@]}" timeout 300 python3 -m pytest "$OLDPWD/tests/python" -q -s \
        -k "(cuda or gpu) and (512 or unsupported)" -p no:cacheprovider \
        >"$OUT/pytest_${path%%=*}.log" 2>&1); rc=$?
      tail -1 "$OUT/pytest_${path%%=*}.log"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_${path%%=*}.log" | head
      grep -q "kernels cannot run" "$OUT/pytest_${path%%=*}.log" && { echo "FAIL: fell back"; rc=1; }
      [ $rc = 0 ] || status=1
    done ;;
  bench)
    echo "== standalone bench (${BENCH_PATHS:-default}) =="
    for path in ${BENCH_PATHS:-default}; do
      timeout 200 $BIN --no-check --bench --bench-reps 5 --path $path >"$OUT/bench_$path.log" 2>&1
      echo "rc=$?"; grep "^|" "$OUT/bench_$path.log"
    done ;;
  sdpa)
    echo "== bench/attention.py: DualKV vs SDPA memory-efficient (rows) and its 3-pass =="
    timeout 400 python3 bench/attention.py "${SHAPES[@]}" --methods "${METHODS:-dualkv,sdpa_mem,mem_3pass}" \
      --warmup 1 --repeats 3 --out "$OUT" 2>&1 | tee "$OUT/attention.log" | tail -9 ;;
  ncu)
    echo "== ncu kernel durations (first bench shape, default path) =="
    timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum --launch-count 8 \
      -k "regex:fwd_ws|dkdv|dq_kernel|bwd_pre" $BIN --no-check --bench --bench-reps 1 \
      --path default >"$OUT/ncu.log" 2>&1
    echo "rc=$?"; grep -E "^  [a-z_]|gpu__time_duration" "$OUT/ncu.log" | sed 's/(dualkv::[^)]*)//' | cut -c1-120 ;;
  d512bwd)
    # A hang (timeout, rc 124) skips the rest of this step: every later part would hang too.
    hung=0
    for path in default sm90-d512-sm80; do
      [ $hung = 1 ] && break
      echo "== standalone: D = 512 matrix + race 20, path $path =="
      timeout 150 $BIN --race 20 --path $path >"$OUT/d512bwd_test_$path.log" 2>&1; rc=$?
      grep -E "FAIL|error|note|reproduce" "$OUT/d512bwd_test_$path.log" | head -20
      tail -2 "$OUT/d512bwd_test_$path.log"
      grep -q "kernels cannot run" "$OUT/d512bwd_test_$path.log" && { echo "FAIL: fell back"; rc=1; }
      echo "rc=$rc"; [ $rc = 0 ] || status=1; [ $rc = 124 ] && hung=1
    done
    if [ $hung = 0 ]; then
      echo "== compute-sanitizer memcheck (--small, path default) =="
      timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $BIN --small --seed 1 \
        --path default >"$OUT/d512bwd_memcheck.log" 2>&1; rc=$?
      grep -E "ERROR SUMMARY|correctness" "$OUT/d512bwd_memcheck.log" | tail -2; echo "rc=$rc"
      [ $rc = 0 ] || status=1
      echo "== bench: default (wgmma backward) vs sm90-d512-sm80 (sm_80 backward) =="
      for path in default sm90-d512-sm80; do
        timeout 100 $BIN --no-check --bench --bench-reps 5 --path $path \
          >"$OUT/d512bwd_bench_$path.log" 2>&1
        echo "rc=$?"; grep "^|" "$OUT/d512bwd_bench_$path.log" | grep -v "^|---" | tail -n +2
      done
      echo "== ncu kernel durations (first bench shape, path default) =="
      timeout 100 ncu --clock-control none --metrics gpu__time_duration.sum --launch-count 8 \
        -k "regex:fwd_ws|dkdv|dq_|bwd_pre" $BIN --no-check --bench --bench-reps 1 \
        --path default >"$OUT/d512bwd_ncu.log" 2>&1
      echo "rc=$?"
      grep -E "^  [a-z_]|gpu__time_duration" "$OUT/d512bwd_ncu.log" | sed 's/(dualkv::[^)]*)//' |
        cut -c1-120
      # The path must really have run the new kernels (an unread switch would test sm_80 twice).
      for k in dkdv_ws512 dq_ws512; do
        grep -q "$k" "$OUT/d512bwd_ncu.log" || { echo "FAIL: no $k kernel in the ncu log"; status=1; }
      done
    fi ;;
  fwd2)
    if check_default; then
      echo "== bench: the cluster forward (both shapes) =="
      timeout 40 $BIN --no-check --bench --bench-reps 5 \
        --path default "${SHAPES[@]}" >"$OUT/fwd2_bench.log" 2>&1
      echo "rc=$?"; grep "^|" "$OUT/fwd2_bench.log" | grep -v "^|---" | tail -n +2 | cut -d"|" -f2-3
      echo "== ncu forward kernel durations (both shapes) =="
      timeout 50 ncu --clock-control none \
        --metrics gpu__time_duration.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
        -k "regex:fwd_d512" $BIN --no-check --bench --bench-reps 1 \
        --path default "${SHAPES[@]}" >"$OUT/fwd2_ncu.log" 2>&1
      echo "rc=$?"
      # kernel, grid, duration, tensor pipe active (% of peak)
      awk '/^  void /{n=$2; sub(/<.*/,"",n); g=$0; sub(/.*\) \(/,"(",g); sub(/\)x.*/,")",g)}
        /gpu__time_duration/{d=$(NF-1) " " $NF}
        /pipe_tensor_op_hmma/{print n, g, d, "tensor " $NF "%"}' "$OUT/fwd2_ncu.log"
      # The default must really run the cluster kernel.
      grep -q "fwd_d512_cluster" "$OUT/fwd2_ncu.log" ||
        { echo "FAIL: no fwd_d512_cluster kernel in the ncu log"; status=1; }
    fi ;;
  *) echo "unknown step $s"; status=1 ;;
  esac
done
exit $status
