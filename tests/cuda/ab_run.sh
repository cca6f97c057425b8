#!/usr/bin/env bash
# One device call for an A/B of kernel paths and trees: builds this tree (NEW) and each other tree
# given as NAME=DIR (a copy of an older or another branch's tree, carried), checks NEW's paths
# (QUICK_PATHS: the quick matrix + race 3, first; CHECK_PATHS: the matrix + race 3;
# MEMCHECK_PATHS: compute-sanitizer memcheck on --small; timeouts QUICK_TIMEOUT / CHECK_TIMEOUT;
# a path that hangs is left out of the later steps and the bench), then benches NEW's BENCH_PATHS with the paths in turn
# (--bench-rounds ROUNDS) and each other tree's default path, at BENCH_SHAPES (NEW only:
# OTHER_SHAPES excludes shapes an older binary does not parse, e.g. multi,...; OTHER_DIMS: the
# head dims of the other trees' builds, default DIMS). Every step has a
# timeout, the script a deadline (BUDGET, default 540 s). Logs in $OUT (at most 8 files).
#   OUT=... CHECK_PATHS=sm90-sepdq BENCH_PATHS=default,sm90-sepdq \
#     bash tests/cuda/ab_run.sh OLD=.wt_old
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.out/ab}"
mkdir -p "$OUT"
DIMS=${DIMS:-64;128;256}
OTHER_DIMS=${OTHER_DIMS:-$DIMS}
ROUNDS=${ROUNDS:-3}
BENCH_PATHS=${BENCH_PATHS:-default}
QUICK_PATHS=${QUICK_PATHS:-} CHECK_PATHS=${CHECK_PATHS:-} MEMCHECK_PATHS=${MEMCHECK_PATHS:-}
BENCH_SHAPES=${BENCH_SHAPES:-16,2048,2048,16,16,64 16,8192,1024,32,8,128 32,4096,2048,32,8,128 16,8192,1024,16,8,256 multi,32,8,128}
source tests/cuda/run_lib.sh
budget 540
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
jobs=$((16 / ($# + 1)))
build_bin . build/ab-new "$DIMS" 300 "$jobs" & pids=($!)
for t in "$@"; do
  build_bin "${t#*=}" "build/ab-${t%%=*}" "$OTHER_DIMS" 300 "$jobs" & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || exit 1; done
BIN=build/ab-new/tests/cuda/dualkv_cuda_test
echo "builds $(($(date +%s) - START)) s"
: >"$OUT/test.log"
: >"$OUT/summary.txt"
# Quick checks first (a hang shows within QUICK_TIMEOUT); a path that hung anywhere is left out
# of the later checks, memcheck and the bench.
for p in ${QUICK_PATHS//,/ }; do check "$p" "${QUICK_TIMEOUT:-60}" --path "$p" --quick --race 3; done
for p in ${CHECK_PATHS//,/ }; do
  case " $hung " in *" $p "*) continue ;; esac
  check "$p" "${CHECK_TIMEOUT:-150}" --path "$p" --race 3
done
for p in ${MEMCHECK_PATHS//,/ }; do
  case " $hung " in *" $p "*) continue ;; esac
  memcheck "$p" "$p" 90
done
rm -f "$OUT/one.log"
kept=()
for p in ${BENCH_PATHS//,/ }; do
  case " $hung " in *" $p "*) echo "$p hung: not benched" ;; *) kept+=("$p") ;; esac
done
BENCH_PATHS=$(IFS=,; echo "${kept[*]}")
shapes=()
for s in $BENCH_SHAPES; do shapes+=(--shape "$s"); done
oshapes=()
for s in ${OTHER_SHAPES:-$BENCH_SHAPES}; do [[ $s == multi* ]] || oshapes+=(--shape "$s"); done
if [ -n "$BENCH_PATHS" ] && step "bench NEW ($BENCH_PATHS)" 60; then
  timeout $(($(left) - 20)) $BIN --no-check --bench --bench-reps 5 --bench-rounds "$ROUNDS" \
    --path "$BENCH_PATHS" "${shapes[@]}" >"$OUT/bench_NEW.log" 2>&1
  echo "bench NEW rc=$?"
fi
for t in "$@"; do
  n=${t%%=*}
  step "bench $n (default)" 40 || continue
  timeout $(($(left) - 10)) "build/ab-$n/tests/cuda/dualkv_cuda_test" --no-check --bench \
    --bench-reps 5 --bench-rounds "$ROUNDS" --path default "${oshapes[@]}" >"$OUT/bench_$n.log" 2>&1
  echo "bench $n rc=$?"
done
echo "done after $(($(date +%s) - START)) s, status $status"
cat "$OUT/summary.txt"
for f in "$OUT"/bench_*.log; do
  echo "## $(basename "$f" .log)"
  grep "^|" "$f" | grep -v "^|---" | grep -v "^| layout" | cut -d'|' -f2-5
done
exit $status
