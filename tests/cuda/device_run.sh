#!/usr/bin/env bash
# One device call: standalone CUDA tests, sanitizers on small cases, then the benchmark.
# Expects the prebuilt binary at .out/dualkv_cuda_test (built on the dev machine), logs to $OUT.
#   bash tests/cuda/device_run.sh [test] [sanitize] [bench]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.out/run}"
mkdir -p "$OUT"
ldconfig -p | grep -q libgomp.so.1 || export LD_LIBRARY_PATH="$PWD/.out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
BIN=.out/dualkv_cuda_test
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(test sanitize bench)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
status=0
for s in "${steps[@]}"; do
  case "$s" in
  test)
    echo "== correctness (full matrix, race 100) =="
    timeout 300 $BIN --race 100 >"$OUT/test.log" 2>&1; rc=$?
    grep -E "FAIL|error|note" "$OUT/test.log" | head -30; tail -2 "$OUT/test.log"; echo "rc=$rc"
    [ $rc = 0 ] || status=1 ;;
  sanitize)
    for tool in memcheck racecheck; do
      echo "== compute-sanitizer $tool (--small) =="
      timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 $BIN --small --seed 1 >"$OUT/san_$tool.log" 2>&1
      rc=$?; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|correctness" "$OUT/san_$tool.log" | tail -3; echo "rc=$rc"
      [ $rc = 0 ] || status=1
    done ;;
  bench)
    echo "== bench =="
    timeout 300 $BIN --no-check --bench >"$OUT/bench.log" 2>&1; echo "rc=$?"
    cat "$OUT/bench.log" ;;
  esac
done
exit $status
