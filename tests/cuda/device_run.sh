#!/usr/bin/env bash
# One device call: standalone CUDA tests, sanitizers on small cases, then the benchmark.
# Expects the prebuilt binary at .out/dualkv_cuda_test (built on the dev machine), logs to $OUT.
#   bash tests/cuda/device_run.sh [test] [test-exp] [sanitize] [sanitize-exp] [bench]
# test-exp / sanitize-exp: the same with DUALKV_SM90_EXPERIMENTAL=1 (the unverified FA3-style
# sm_90a forward and dK/dV). bench always has rows for the experimental path next to the default
# ones, unless test-exp ran before it in this call and timed out or crashed (then --bench-no-exp:
# a broken kernel could hang the bench).
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
exp_ok=1
# The library warns on stderr when the experimental path was asked for but fell back.
fallback_check() {
  if grep -q "DUALKV_SM90_EXPERIMENTAL=1 but the experimental kernel cannot run" "$1"; then
    echo "FAIL: the experimental kernel did not run (fell back): see $1"
    return 1
  fi
}
for s in "${steps[@]}"; do
  case "$s" in
  test)
    echo "== correctness (full matrix, race 100) =="
    timeout 240 $BIN --race 100 >"$OUT/test.log" 2>&1; rc=$?
    grep -E "FAIL|error|note" "$OUT/test.log" | head -30; tail -2 "$OUT/test.log"; echo "rc=$rc"
    [ $rc = 0 ] || status=1 ;;
  test-exp)
    echo "== correctness, DUALKV_SM90_EXPERIMENTAL=1 (full matrix, race 100) =="
    DUALKV_SM90_EXPERIMENTAL=1 timeout 200 $BIN --race 100 >"$OUT/test_exp.log" 2>&1; rc=$?
    grep -E "FAIL|error|note" "$OUT/test_exp.log" | head -30; tail -2 "$OUT/test_exp.log"; echo "rc=$rc"
    fallback_check "$OUT/test_exp.log" || rc=1
    [ $rc = 0 ] || status=1
    # Wrong numbers (rc 1) still leave the exp timings meaningful; a hang or crash does not.
    [ $rc = 0 ] || [ $rc = 1 ] || exp_ok=0 ;;
  sanitize | sanitize-exp)
    env_exp=""
    tools="memcheck racecheck"
    # Experimental: memcheck only (racecheck already hits its limit on the verified path).
    [ "$s" = sanitize-exp ] && env_exp="DUALKV_SM90_EXPERIMENTAL=1" && tools="memcheck"
    for tool in $tools; do
      echo "== compute-sanitizer $tool (--small) ${env_exp} =="
      log="$OUT/san_${tool}${env_exp:+_exp}.log"
      env $env_exp timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 $BIN --small --seed 1 >"$log" 2>&1
      rc=$?; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|correctness" "$log" | tail -3; echo "rc=$rc"
      [ -n "$env_exp" ] && { fallback_check "$log" || rc=1; }
      [ $rc = 0 ] || status=1
    done ;;
  bench)
    echo "== bench =="
    extra=""
    [ $exp_ok = 1 ] || extra="--bench-no-exp"
    timeout 240 $BIN --no-check --bench $extra >"$OUT/bench.log" 2>&1; echo "rc=$?"
    fallback_check "$OUT/bench.log" || status=1
    cat "$OUT/bench.log" ;;
  *) echo "unknown step $s"; status=1 ;;
  esac
done
exit $status
