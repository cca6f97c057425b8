#!/usr/bin/env bash
# One device call for the kernel variants (the A/B paths of D = 512 and D = 256, the experimental
# fused-backward variants DUALKV_SM90_BWD_VARIANT=1|2|3 at D = 64/128) and an A/B of the
# default path: builds this tree
# and an older one (OLD_TREE, copied into an ignored folder and carried), checks the variants
# (matrix + race, memcheck on --small), checks this tree's default path (quick matrix + race),
# then benches the default path of both trees and each variant beside this tree's default.
# Every step has a timeout; a hung variant skips its bench. Logs: $OUT (at most 8 files).
#   OUT=... bash tests/cuda/variants_run.sh OLD_TREE
#   BWDVAR_ONLY=1 OUT=... bash tests/cuda/variants_run.sh   only the fused-backward variants: this
#     tree at D = 64, 128 (their check, memcheck and bench beside the default; no OLD_TREE)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.out/variants}"
mkdir -p "$OUT"
BWDVAR_ONLY=${BWDVAR_ONLY:-0}
if [ "$BWDVAR_ONLY" = 1 ]; then
  DIMS="64;128"
else
  DIMS="64;128;256;512"
  OLD_TREE=${1:?usage: variants_run.sh OLD_TREE}
fi
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
build() {  # SRC DIR
  cmake -S "$1" -B "$2" -G Ninja -DDUALKV_BUILD_TORCH=OFF -DDUALKV_BUILD_TESTS=ON -DDUALKV_CUDA=ON \
    "-DDUALKV_CUDA_HEAD_DIMS=$DIMS" -DDUALKV_CUDA_ARCHS=90a >>"$OUT/build.log" 2>&1 &&
    timeout 300 cmake --build "$2" -j8 --target dualkv_cuda_test >>"$OUT/build.log" 2>&1
}
build . build/var-new & b1=$!
[ "$BWDVAR_ONLY" = 1 ] || { build "$OLD_TREE" build/var-old & b2=$!; }
wait $b1 || { tail -30 "$OUT/build.log"; exit 1; }
[ "$BWDVAR_ONLY" = 1 ] || wait $b2 || { tail -30 "$OUT/build.log"; exit 1; }
NEW=build/var-new/tests/cuda/dualkv_cuda_test
OLD=build/var-old/tests/cuda/dualkv_cuda_test
echo "builds $(($(date +%s) - T0)) s"
source tests/cuda/run_lib.sh
BIN=$NEW
: >"$OUT/test.log"
: >"$OUT/summary.txt"
if [ "$BWDVAR_ONLY" != 1 ]; then
  check d512 80 --path sm90-d512-nopipe --race 10
  check d256 100 --path sm90-d256-sync,sm90-d256ws-fdq --race 10
fi
check bwdvar 120 --path sm90-bwd-v1,sm90-bwd-v2,sm90-bwd-v3 --race 10
check default-quick 60 --path default --quick --race 5
if [ "$BWDVAR_ONLY" != 1 ]; then
  case "$hung" in *d512*) ;; *) memcheck d512-nopipe sm90-d512-nopipe ;; esac
  case "$hung" in *d256*) ;; *) memcheck d256ws-fdq sm90-d256ws-fdq ;; esac
fi
case "$hung" in *bwdvar*) ;; *)
  memcheck bwd-v1 sm90-bwd-v1
  memcheck bwd-v3 sm90-bwd-v3 ;; esac
rm -f "$OUT/one.log"
D128=(--shape 16,8192,1024,32,8,128 --shape 32,4096,2048,32,8,128 --shape 8,16384,2048,32,8,128
  --shape 16,8192,1024,16,8,128 --shape 16,2048,2048,16,16,64)
for b in OLD NEW; do
  [ "$BWDVAR_ONLY" = 1 ] && continue
  timeout 60 "${!b}" --no-check --bench --bench-reps 5 --path default,sm90-sepdq "${D128[@]}" \
    >"$OUT/bench_$b.log" 2>&1
  echo "bench $b rc=$?"
done
{
  [ "$BWDVAR_ONLY" = 1 ] && hung="$hung d512 d256"
  case "$hung" in *d512*) ;; *)
    timeout 60 $NEW --no-check --bench --bench-reps 3 --path default,sm90-d512-nopipe \
      --shape 16,8192,1024,32,4,512 --shape 8,16384,2048,32,4,512 ;; esac
  case "$hung" in *d256*) ;; *)
    timeout 60 $NEW --no-check --bench --bench-reps 5 --path default,sm90-d256-sync,sm90-d256ws-fdq \
      --shape 16,8192,1024,16,8,256 --shape 8,16384,2048,16,8,256 ;; esac
  case "$hung" in *bwdvar*) ;; *)
    timeout 60 $NEW --no-check --bench --bench-reps 5 --path default,sm90-bwd-v1 \
      --shape 16,8192,1024,32,8,128 --shape 8,16384,2048,32,8,128 --shape 16,8192,1024,16,8,128
    timeout 40 $NEW --no-check --bench --bench-reps 5 \
      --path default,sm90-bwd-v1,sm90-bwd-v2,sm90-bwd-v3 --shape 16,2048,2048,16,16,64 ;; esac
} >"$OUT/bench_variants.log" 2>&1
echo "total $(($(date +%s) - T0)) s, status $status"
cat "$OUT/summary.txt"
for f in bench_OLD bench_NEW bench_variants; do
  [ -f "$OUT/$f.log" ] || continue
  echo "## $f"
  grep "^|" "$OUT/$f.log" | grep -v "^|---" | cut -c1-230
done
exit $status
