#!/usr/bin/env bash
# One device call for issue 32's experimental D = 64 tiles (DUALKV_SM90_D64_TILES; NOTES.md, lab
# notebook "Fifteenth session"): builds this tree's dualkv_cuda_test for head dim 64 (sm_90a);
# the quick matrix + race 3 on the switch's paths (a hang shows within a minute; after a hang
# only the default is timed and the hung path is not checked further); times the switch off and
# on, the paths in turn, on plain causal 16K (16 / 16 heads) and the packed (16, 2048, 2048)
# shape; then the full D = 64 matrix (prompt/response layouts and prefix trees, GQA / MQA,
# window, softcap + dlse, bf16 / fp16; forward and backward, each also in deterministic mode) +
# race 3, random prefix-tree forests and memcheck on --small. The bench comes before the long
# checks so that a short budget still times; a path that fails a check is flagged in
# summary.txt. Logs in $OUT; the table last.
#   OUT=... bash tests/cuda/d64_ab.sh
# Env: CHECK_PATHS (default d64-tiles: both new kernels; d64-fwd192 / d64-bwd128 run one each),
# BENCH_PATHS (default: the switch's four settings), ROUNDS (3), BUDGET (seconds, 390), JOBS
# (build jobs, 16).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.out/d64}"
mkdir -p "$OUT"
CHECK_PATHS=${CHECK_PATHS:-d64-tiles}
BENCH_PATHS=${BENCH_PATHS:-default,d64-fwd192,d64-bwd128,d64-tiles}
ROUNDS=${ROUNDS:-3}
source tests/cuda/run_lib.sh
budget 390
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
build_bin . build/d64 64 240 "${JOBS:-16}" || exit 1
echo "build $(($(date +%s) - START)) s"
: >"$OUT/test.log"
: >"$OUT/summary.txt"
for p in ${CHECK_PATHS//,/ }; do check "$p-quick" 60 --path "$p" --quick --race 3; done
# A hang implicates the new kernels of every experimental path: time the default only.
[ -n "$hung" ] && { echo "hung:$hung: the default path only is timed"; BENCH_PATHS=default; }
if step "bench ($BENCH_PATHS)" 45; then
  timeout 150 $BIN --no-check --bench --bench-reps 5 --bench-rounds "$ROUNDS" \
    --path "$BENCH_PATHS" --shape 1,16384,0,16,16,64 --shape 16,2048,2048,16,16,64 \
    >"$OUT/bench.log" 2>&1
  echo "bench rc=$?"
  grep -q "cannot run" "$OUT/bench.log" && { echo "FAIL: a path fell back"; status=1; }
fi
for p in ${CHECK_PATHS//,/ }; do
  case " $hung " in *" $p-quick "*) continue ;; esac
  check "$p" 150 --path "$p" --race 3
  check "$p-trees" 90 --path "$p" --trees 2 --race 0
  memcheck "$p" "$p" 90
done
rm -f "$OUT/one.log"
echo "done after $(($(date +%s) - START)) s, status $status"
cat "$OUT/summary.txt"
echo "## ms (useful TF/s), paths in turn, median of $ROUNDS rounds"
grep "^|" "$OUT/bench.log" 2>/dev/null | grep -v "^|---" | cut -d'|' -f2-5
exit $status
