#!/usr/bin/env bash
# One device call: standalone CUDA tests, sanitizers on small cases, then the benchmark.
# Expects the prebuilt binary at .out/dualkv_cuda_test (built on the dev machine), logs to $OUT.
#   bash tests/cuda/device_run.sh [test] [trees] [sanitize] [bench]
# Every step covers each kernel path of dualkv_cuda_test's kPaths (default = sm_90a on Hopper,
# sm80, sm90-nopp, and the A/B paths sm90-sepdq at D <= 128, sm90-d512-sm80 at D = 512);
# racecheck runs the
# sm80 path only (on the wgmma paths it outruns its time limit). `trees` (not in the default
# steps): TREES rounds (default 3) of the random prefix-tree forests on every path, then the bench
# of the branching-rollout forest next to the depth-two micro-batch at the same heads.
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
# The library warns on stderr when the warp-specialised path could not run and fell back.
fallback_check() {
  if grep -q "warp-specialised sm_90a kernels cannot run" "$1"; then
    echo "FAIL: the warp-specialised kernels did not run (fell back): see $1"
    return 1
  fi
}
for s in "${steps[@]}"; do
  case "$s" in
  test)
    echo "== correctness (full matrix, every path, race 100) =="
    timeout 500 $BIN --race 100 >"$OUT/test.log" 2>&1; rc=$?
    grep -E "FAIL|error|note" "$OUT/test.log" | head -30; tail -2 "$OUT/test.log"; echo "rc=$rc"
    fallback_check "$OUT/test.log" || rc=1
    [ $rc = 0 ] || status=1 ;;
  trees)
    echo "== prefix trees: ${TREES:-3} rounds of random forests, every path =="
    timeout 360 $BIN --trees "${TREES:-3}" --race 0 >"$OUT/trees.log" 2>&1; rc=$?
    grep -E "FAIL|error" "$OUT/trees.log" | head -30; tail -2 "$OUT/trees.log"; echo "rc=$rc"
    fallback_check "$OUT/trees.log" || rc=1
    [ $rc = 0 ] || status=1
    echo "== bench: branching-rollout forest vs the depth-two micro-batch (default path) =="
    timeout 200 $BIN --no-check --bench --bench-reps 5 --path default --shape tree,32,8,128 \
      --shape multi,32,8,128 --shape tree,16,8,256 --shape multi,16,8,256 \
      >"$OUT/trees_bench.log" 2>&1; echo "rc=$?"
    fallback_check "$OUT/trees_bench.log" || status=1
    grep -E '^\|' "$OUT/trees_bench.log" ;;
  sanitize)
    for run in "memcheck all" "racecheck sm80"; do
      set -- $run
      tool=$1 path=$2
      echo "== compute-sanitizer $tool (--small, path $path) =="
      log="$OUT/san_${tool}.log"
      args=(--small --seed 1)
      [ "$path" = all ] || args+=(--path "$path")
      timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 9 $BIN "${args[@]}" >"$log" 2>&1
      rc=$?; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|correctness" "$log" | tail -3; echo "rc=$rc"
      fallback_check "$log" || rc=1
      [ $rc = 0 ] || status=1
    done ;;
  bench)
    echo "== bench =="
    timeout 240 $BIN --no-check --bench >"$OUT/bench.log" 2>&1; echo "rc=$?"
    fallback_check "$OUT/bench.log" || status=1
    cat "$OUT/bench.log" ;;
  *) echo "unknown step $s"; status=1 ;;
  esac
done
exit $status
