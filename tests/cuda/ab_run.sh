#!/usr/bin/env bash
# A/B of kernel changes in one device call: an older source tree (copied into an ignored folder,
# e.g. `git archive <commit> | tar -x -C .out/oldtree`, and carried) and this tree, both built
# here as standalone test binaries, benched side by side at the reference shapes (the bench times
# every path's backward in default and deterministic mode), then this tree's binary checked.
#   OUT=... bash tests/cuda/ab_run.sh OLD_TREE [PATHS]     (PATHS: --path list, default
#   "default,sm90-sepdq"; both trees must know those names)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.out/ab}"
mkdir -p "$OUT"
OLD_TREE=${1:?usage: ab_run.sh OLD_TREE [PATHS]}
PATHS=${2:-default,sm90-sepdq}
T0=$(date +%s)
build() {  # build SRC DIR
  cmake -S "$1" -B "$2" -G Ninja -DDUALKV_BUILD_TORCH=OFF -DDUALKV_BUILD_TESTS=ON -DDUALKV_CUDA=ON \
    "-DDUALKV_CUDA_HEAD_DIMS=64;128;256;512" -DDUALKV_CUDA_ARCHS=90a >>"$OUT/build.log" 2>&1 &&
    timeout 300 cmake --build "$2" -j16 --target dualkv_cuda_test >>"$OUT/build.log" 2>&1
}
build "$OLD_TREE" build/ab-old || { tail -30 "$OUT/build.log"; exit 1; }
build . build/ab-new || { tail -30 "$OUT/build.log"; exit 1; }
OLD=build/ab-old/tests/cuda/dualkv_cuda_test
NEW=build/ab-new/tests/cuda/dualkv_cuda_test
echo "builds $(($(date +%s) - T0)) s"
SH=(--shape 16,8192,1024,32,8,128 --shape 32,4096,2048,32,8,128 --shape 8,16384,2048,32,8,128
  --shape 16,8192,1024,16,8,128 --shape 16,2048,2048,16,16,64 --shape 16,8192,1024,16,8,256
  --shape 16,8192,1024,32,4,512)
for b in OLD NEW; do
  timeout 150 "${!b}" --no-check --bench --bench-reps 5 --path "$PATHS" "${SH[@]}" \
    >"$OUT/bench_$b.log" 2>&1
  echo "$b rc=$?"
done
echo "== correctness (this tree): the matrix on --path $PATHS, race 10"
timeout 200 $NEW --path "$PATHS" --race 10 >"$OUT/test.log" 2>&1
echo "rc=$?"
grep -E "FAIL|reproduce" "$OUT/test.log" | head
tail -1 "$OUT/test.log"
echo "total $(($(date +%s) - T0)) s"
for b in OLD NEW; do
  echo "## $b"
  grep "^|" "$OUT/bench_$b.log" | grep -v "^|---"
done
