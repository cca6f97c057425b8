#!/usr/bin/env bash
# A/B of kernel changes in one device call: a standalone test binary of an older tree (built on
# the dev machine, carried in .out/, libgomp in .out/lib) against this tree's, built here; both
# benched side by side at the reference shapes (separate and fused dQ), then this tree's binary
# checked on the default, D = 512 wgmma and synchronous paths.
#   OUT=... bash tests/cuda/ab_run.sh [OLD_BINARY]     (default .out/dualkv_cuda_test)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.out/ab}"
mkdir -p "$OUT"
ldconfig -p | grep -q libgomp.so.1 || export LD_LIBRARY_PATH="$PWD/.out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
OLD=${1:-.out/dualkv_cuda_test}
T0=$(date +%s)
cmake -S . -B build/ab -G Ninja -DDUALKV_BUILD_TORCH=OFF -DDUALKV_BUILD_TESTS=ON -DDUALKV_CUDA=ON \
  "-DDUALKV_CUDA_HEAD_DIMS=64;128;256;512" -DDUALKV_CUDA_ARCHS=90a >"$OUT/build.log" 2>&1
timeout 300 cmake --build build/ab -j16 --target dualkv_cuda_test >>"$OUT/build.log" 2>&1 ||
  { tail -30 "$OUT/build.log"; exit 1; }
NEW=build/ab/tests/cuda/dualkv_cuda_test
echo "build $(($(date +%s) - T0)) s"
SH=(--shape 16,8192,1024,32,8,128 --shape 32,4096,2048,32,8,128 --shape 8,16384,2048,32,8,128
  --shape 16,8192,1024,16,8,128 --shape 16,2048,2048,16,16,64)
for b in OLD NEW; do
  timeout 100 "${!b}" --no-check --bench --bench-reps 5 --path default --dq-modes "${DQ_MODES:-0,5}" \
    "${SH[@]}" >"$OUT/bench_$b.log" 2>&1
  echo "$b rc=$?"
  timeout 100 "${!b}" --no-check --bench --bench-reps 5 --path sm90-d512bwd \
    --shape 16,8192,1024,32,4,512 >"$OUT/bench512_$b.log" 2>&1
  echo "$b D=512 rc=$?"
done
for run in "default --dq-modes ${DQ_MODES:-0,5} --race 10" "sm90-d512bwd --race 5" "sm90-sync --race 3"; do
  set -- $run
  echo "== correctness (this tree): --path $run"
  timeout 150 $NEW --path "$@" >"$OUT/test_$1.log" 2>&1
  echo "rc=$?"
  grep -E "FAIL|reproduce" "$OUT/test_$1.log" | head
  tail -1 "$OUT/test_$1.log"
done
echo "total $(($(date +%s) - T0)) s"
for b in OLD NEW; do
  echo "## $b"
  grep "^|" "$OUT/bench_$b.log" | grep -v "^|---"
  grep "^| sm90" "$OUT/bench512_$b.log" | cut -c1-110
done
