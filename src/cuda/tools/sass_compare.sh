#!/usr/bin/env bash
# Machine-code check for moves and refactors of the CUDA kernels (no GPU needed).
#   sass_compare.sh dump TREE OUT   SASS of every dualkv_cuda translation unit of the source tree
#                                   TREE (the generated instantiations for all head dims, dtypes
#                                   and passes, made by TREE's own CMakeLists, + the hand-written
#                                   .cu files), each compiled for sm_80 and sm_90a with the
#                                   library's flags: OUT/<unit>.<arch>.sass (code only)
#   sass_compare.sh cmp A B         compares two such dumps listing by listing
# Typical use: git worktree add /tmp/base <commit>; dump /tmp/base and the changed tree; cmp.
# Env: JOBS (parallel compiles, default 2), ONLY (a glob over unit names, default all),
# CUOBJDUMP (default: cuobjdump on PATH), NVDISASM_PATH (cuobjdump's disassembler: the wheels
# nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm provide both).
# The kernels of logits.cu sit in an anonymous namespace whose mangled hash (_GLOBAL__N__<hash>)
# changes with the source folder: cmp masks that hash.
set -euo pipefail
mode=${1:?usage: sass_compare.sh dump TREE OUT | cmp A B}
if [ "$mode" = dump ]; then
  tree=$(cd "${2:?TREE}" && pwd)
  mkdir -p "${3:?OUT}"
  out=$(cd "$3" && pwd)
  rm -rf "$out/cm"
  cmake -S "$tree" -B "$out/cm" -G Ninja -DDUALKV_BUILD_TORCH=OFF -DDUALKV_BUILD_TESTS=OFF \
    -DDUALKV_CUDA=ON "-DDUALKV_CUDA_ARCHS=80-real;90a-real" "-DDUALKV_CUDA_HEAD_DIMS=64;128;256;512" \
    >"$out/cmake.log" 2>&1 || { echo "cmake failed: $out/cmake.log" >&2; exit 1; }
  export TREE="$tree" OUT="$out" CO="${CUOBJDUMP:-cuobjdump}"
  one() {  # one source file, one arch
    local s=$1 a=$2 n
    n=$(basename "$s" .cu).sm$a
    nvcc -std=c++17 -O3 --expt-relaxed-constexpr -lineinfo -DNDEBUG -DDUALKV_HAS_SM90A=1 \
      -DDUALKV_HAS_HD64=1 -DDUALKV_HAS_HD128=1 -DDUALKV_HAS_HD256=1 -DDUALKV_HAS_HD512=1 \
      -gencode=arch=compute_$a,code=sm_$a -cubin -I"$TREE/include" -I"$TREE/src/cuda" "$s" \
      -o "$OUT/$n.cubin" >"$OUT/$n.err" 2>&1 || { echo "FAIL $n (see $OUT/$n.err)"; return 0; }
    "$CO" -sass "$OUT/$n.cubin" |
      grep -vE '^\s*(code for|Fatbin|arch =|code version|host =|compile_size|\.section|-----|$)' \
        >"$OUT/$n.sass"
  }
  export -f one
  { ls "$out"/cm/src/cuda/inst/*.cu; find "$tree/src/cuda" -name '*.cu' | sort; } |
    while read -r s; do
      # shellcheck disable=SC2053
      if [[ $(basename "$s" .cu) == ${ONLY:-*} ]]; then printf '%s 90a\n%s 80\n' "$s" "$s"; fi
    done | xargs -P "${JOBS:-2}" -L1 bash -c 'one "$0" "$1"'
  echo "$(ls "$out"/*.sass 2>/dev/null | wc -l) listings in $out"
elif [ "$mode" = cmp ]; then
  a=${2:?A} b=${3:?B} same=0 bad=0 funcs=0
  mask() { sed -E 's/_GLOBAL__N__[0-9a-f]{8}_/_GLOBAL__N__H_/g' "$1"; }
  for x in "$a"/*.sass; do
    n=$(basename "$x")
    if [ ! -s "$x" ] || [ ! -s "$b/$n" ]; then echo "missing or empty: $n"; bad=$((bad + 1))
    elif cmp -s <(mask "$x") <(mask "$b/$n"); then
      same=$((same + 1)); funcs=$((funcs + $(grep -c 'Function :' "$x" || true)))
    else echo "DIFFERENT: $n"; bad=$((bad + 1)); fi
  done
  for y in "$b"/*.sass; do [ -f "$a/$(basename "$y")" ] || { echo "only in $b: $(basename "$y")"; bad=$((bad + 1)); }; done
  echo "identical: $same listings ($funcs kernels); different or missing: $bad"
  [ "$bad" = 0 ]
else
  echo "usage: sass_compare.sh dump TREE OUT | cmp A B" >&2; exit 2
fi
