# Shared pieces of the device run scripts (tests/cuda/*_run.sh), sourced after `cd` to the repo
# root and OUT / BIN set:
#   budget SECONDS          start the script's deadline (START, BUDGET; BUDGET from the caller's
#                           environment wins)
#   step NAME SECONDS       false (the step is skipped) when fewer than SECONDS are left
#   use_carried_libgomp     .out/lib on LD_LIBRARY_PATH where the machine has no libgomp
#   check NAME TIMEOUT ARGS...
#                           one $BIN correctness run: its log appended to $OUT/test.log, a line in
#                           $OUT/summary.txt; a failure sets status=1, a timeout adds NAME to hung
#   memcheck NAME PATH [TIMEOUT]
#                           compute-sanitizer memcheck of $BIN --small on PATH, logged the same way
#   build_bin SRC DIR DIMS TIMEOUT [JOBS]
#                           configures and builds SRC's dualkv_cuda_test in DIR (head dims DIMS,
#                           sm_90a; JOBS default 16), logged to $OUT/build.log, and sets BIN; on a
#                           failure prints the log's tail and returns 1
build_bin() {
  cmake -S "$1" -B "$2" -G Ninja -DDUALKV_BUILD_TORCH=OFF -DDUALKV_BUILD_TESTS=ON -DDUALKV_CUDA=ON \
    "-DDUALKV_CUDA_HEAD_DIMS=$3" -DDUALKV_CUDA_ARCHS=90a >>"$OUT/build.log" 2>&1 &&
    timeout "$4" cmake --build "$2" -j"${5:-16}" --target dualkv_cuda_test >>"$OUT/build.log" 2>&1 ||
    { tail -30 "$OUT/build.log"; return 1; }
  BIN=$2/tests/cuda/dualkv_cuda_test
}
budget() {
  START=$(date +%s)
  BUDGET="${BUDGET:-$1}"
}
left() { echo $((START + BUDGET - $(date +%s))); }
step() {
  local l
  l=$(left)
  if [ "$l" -lt "$2" ]; then
    echo "== $1: skipped ($l s left)"
    return 1
  fi
  echo "== $1 ($l s left, $(date -u +%H:%M:%S))"
}
use_carried_libgomp() {
  ldconfig -p | grep -q libgomp.so.1 ||
    export LD_LIBRARY_PATH="$PWD/.out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}
status=0
hung=""
check() {
  local name=$1 t=$2 rc
  shift 2
  if [ -n "${START:-}" ]; then step "correctness: $name" 20 || { status=1; return 0; }; fi
  echo "### $name: $*" >>"$OUT/test.log"
  timeout "$t" $BIN "$@" >"$OUT/one.log" 2>&1
  rc=$?
  cat "$OUT/one.log" >>"$OUT/test.log"
  grep -E "FAIL|reproduce" "$OUT/one.log" | head -10
  grep -q "kernels cannot run" "$OUT/one.log" && { echo "FAIL: fell back"; rc=1; }
  echo "$name: $(grep -E "^correctness|ERROR SUMMARY" "$OUT/one.log" | tail -1), rc=$rc" |
    tee -a "$OUT/summary.txt"
  [ $rc = 0 ] || status=1
  [ $rc = 124 ] && hung="$hung $name"
  return 0
}
memcheck() {
  local rc
  if [ -n "${START:-}" ]; then step "memcheck: $1" 60 || return 0; fi
  echo "### memcheck $1" >>"$OUT/test.log"
  timeout "${3:-45}" compute-sanitizer --tool memcheck --error-exitcode 9 $BIN --small --seed 1 \
    --path "$2" >"$OUT/one.log" 2>&1
  rc=$?
  cat "$OUT/one.log" >>"$OUT/test.log"
  echo "memcheck $1: $(grep -E "ERROR SUMMARY" "$OUT/one.log" | tail -1), rc=$rc" |
    tee -a "$OUT/summary.txt"
  [ $rc = 0 ] || status=1
  return 0
}
