#!/usr/bin/env bash
# A/B of the key walk's memo of the last middle ancestor (src/cuda/collective/walks.h, kMemo) on
# the GPU machine, one call (~8 min): two builds of this tree (D = 128, sm_90a), as it is (no
# memo) and with DUALKV_WALK_MEMO=1, into .ab/base and .ab/memo; then
# bench/attention.py, DualKV alone, on the tree batches as listed (a segment per turn: the
# deepest walks), the long-horizon one and the depth-two twins, the builds alternating (base,
# memo, base, memo); the tables last.
#   OUT=$OUT bash bench/walk_memo_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-.out/walk_memo_ab}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for build in base memo; do
  flag=$([ "$build" = memo ] && echo "-DDUALKV_WALK_MEMO=1" || echo "")
  echo "== build $build ($flag) =="
  rm -rf "build/ab-$build"
  CMAKE_ARGS="-DDUALKV_CUDA=ON -DDUALKV_CUDA_HEAD_DIMS=128 -DDUALKV_CUDA_ARCHS=90a-real \
-DCMAKE_CUDA_FLAGS=$flag" CMAKE_BUILD_PARALLEL_LEVEL=16 \
    timeout 200 python3 -m pip install --no-build-isolation --no-deps -q --target ".ab/$build" \
    -C "build-dir=build/ab-$build" . >"$OUT/build_$build.log" 2>&1 ||
    { tail -30 "$OUT/build_$build.log"; exit 1; }
done
for round in 1 2; do
  [ "$round" = 2 ] && [ "$SECONDS" -gt 330 ] && { echo "(no time for round 2)"; break; }
  for build in base memo; do
    echo "== round $round: $build =="
    PYTHONPATH=".ab/$build" timeout 150 python3 bench/attention.py \
      --shapes tree,tree-deep,tree-d2 --tree-segments listed --methods dualkv --rounds 1 \
      --out "$OUT/$build-$round" >"$OUT/$build-$round.log" 2>&1 || echo "round $round $build: rc $?"
  done
done
for build in base memo; do
  echo "== $build =="
  for round in 1 2; do [ -f "$OUT/$build-$round.log" ] && sed -n '/^GPU /,$p' "$OUT/$build-$round.log"; done
done
