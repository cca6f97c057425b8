#!/usr/bin/env bash
# The fused-dQ backward variants (DUALKV_ATOMIC_DQ=2..5, sm90_bwd_ws.cuh) in one device call:
# the backward timed per dq mode at the reference shapes, the correctness matrix on the default
# path with the fused modes, ncu kernel durations per mode, and a full ncu profile (stall reasons,
# hottest SASS lines) of the dK/dV kernel of mode 2 and of the fastest new mode. Every step has
# its own timeout and the whole script a deadline (BUDGET seconds), so what was measured comes
# back even when a step runs long. The binary: .out/dualkv_cuda_test if present (built on the dev
# machine, libgomp in .out/lib), else it is built here with
#   -DDUALKV_CUDA_HEAD_DIMS=128;64 -DDUALKV_CUDA_ARCHS=90a.
#   OUT=... BUDGET=300 bash tests/cuda/fastbwd_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.out/fastbwd}"
mkdir -p "$OUT"
START=$(date +%s)
BUDGET="${BUDGET:-300}"
left() { echo $((START + BUDGET - $(date +%s))); }
# step NAME SECONDS: false (skip) when less than SECONDS are left.
step() {
  local l
  l=$(left)
  if [ "$l" -lt "$2" ]; then
    echo "== $1: skipped ($l s left)"
    return 1
  fi
  echo "== $1 ($l s left, $(date -u +%H:%M:%S))"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
ldconfig -p | grep -q libgomp.so.1 || export LD_LIBRARY_PATH="$PWD/.out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
BIN=.out/dualkv_cuda_test
if ! $BIN --no-check >/dev/null 2>&1; then
  step build 150 || exit 1
  cmake -S . -B build/dev -G Ninja -DDUALKV_BUILD_TORCH=OFF -DDUALKV_BUILD_TESTS=ON \
    -DDUALKV_CUDA=ON "-DDUALKV_CUDA_HEAD_DIMS=128;64" -DDUALKV_CUDA_ARCHS=90a >"$OUT/build.log" 2>&1
  timeout 240 cmake --build build/dev -j16 --target dualkv_cuda_test >>"$OUT/build.log" 2>&1 ||
    { tail -30 "$OUT/build.log"; exit 1; }
  BIN=build/dev/tests/cuda/dualkv_cuda_test
fi
REF=(--shape 16,8192,1024,32,8,128)
MODES=2,3,4,5

# 1. The backward per dq mode (0 = the separate dQ pass, the default), reference shapes.
if step bench 40; then
  timeout 90 $BIN --no-check --bench --bench-reps 5 --path default --dq-modes 0,$MODES \
    "${REF[@]}" --shape 32,4096,2048,32,8,128 --shape 8,16384,2048,32,8,128 \
    --shape 16,8192,1024,16,8,128 --shape 16,2048,2048,16,16,64 >"$OUT/bench.log" 2>&1
  echo "rc=$?"
  grep -q "kernels cannot run" "$OUT/bench.log" && echo "FAIL: fell back"
  grep "^|" "$OUT/bench.log"
fi
# The fastest new mode (3-5) at the first shape: the second ncu profile.
BEST=$(grep "^bench default N=16 P=8192 R=1024 Hq=32" "$OUT/bench.log" 2>/dev/null |
  grep -o "dq mode [345]) [0-9.]*" | sort -t')' -k2 -n | head -1 | cut -c9)
BEST=${BEST:-3}
echo "fastest new mode: $BEST"

# 2. Correctness: the matrix on the default path with every fused mode, race x 10 (the fused
# modes' dk/dv bitwise).
if step "correctness (matrix, default path, dq modes $MODES)" 60; then
  timeout 120 $BIN --path default --dq-modes $MODES --race 10 >"$OUT/test.log" 2>&1
  echo "rc=$?"
  grep -E "FAIL|reproduce" "$OUT/test.log" | head -20
  tail -2 "$OUT/test.log"
fi

# 3. ncu kernel durations per mode (3 backward calls each, modes in --dq-modes order), first shape.
if step "ncu durations" 40; then
  timeout 60 ncu --csv --clock-control none --metrics gpu__time_duration.sum \
    -k "regex:dkdv_ws|dq_ws|dq_convert|bwd_pre" $BIN --no-check --bench --bench-reps 1 \
    --path default --dq-modes 0,$MODES "${REF[@]}" >"$OUT/ncu_durations.csv" 2>&1
  echo "rc=$?"
  python3 - "$OUT/ncu_durations.csv" <<'PY'
import csv, re, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
if rows:
    h = {n: i for i, n in enumerate(rows[0])}
    for r in rows[1:]:
        k = re.sub(r"\(dualkv::cuda::detail::[^)]*\)|dualkv::cuda::detail::", "", r[h["Kernel Name"]])
        print(f"  {k[:90]:90s} {r[h['Metric Value']]:>10s} {r[h['Metric Unit']]}")
PY
fi

# 4. Full profiles of the dK/dV kernel: the new best mode, then mode 2.
for m in "$BEST" 2; do
  if step "ncu --set full, dK/dV kernel, dq mode $m" 75; then
    timeout 120 ncu --clock-control none --set full -k regex:dkdv_ws_kernel_sm90 --launch-count 1 \
      -f -o "$OUT/ncu_mode$m" $BIN --no-check --bench --bench-reps 1 --path default \
      --dq-modes "$m" "${REF[@]}" >"$OUT/ncu_mode$m.log" 2>&1
    echo "rc=$?"
    tail -3 "$OUT/ncu_mode$m.log"
    R="$OUT/ncu_mode$m.ncu-rep"
    if [ -f "$R" ]; then
      timeout 30 ncu --import "$R" --page raw --csv >"$OUT/ncu_mode${m}_raw.csv" 2>>"$OUT/ncu_import.err"
      timeout 30 ncu --import "$R" --page details --csv >"$OUT/ncu_mode${m}_details.csv" \
        2>>"$OUT/ncu_import.err"
      timeout 40 ncu --import "$R" --page source --csv --print-source sass \
        >"$OUT/ncu_mode${m}_source.csv" 2>>"$OUT/ncu_import.err"
      head -c 400 "$OUT/ncu_mode${m}_source.csv"
      echo
      python3 src/cuda/tools/ncu_summary.py "$OUT/ncu_mode${m}_raw.csv" \
        "$OUT/ncu_mode${m}_source.csv" >"$OUT/ncu_mode${m}_summary.txt" 2>&1
      head -60 "$OUT/ncu_mode${m}_summary.txt"
    fi
  fi
done

# 5. With time left: random layouts (D = 64/128 of them run here) with the fused modes.
if step "correctness (random layouts, default path, dq modes $MODES)" 40; then
  timeout $(($(left) - 10)) $BIN --path default --dq-modes $MODES --race 0 --random 20 \
    >"$OUT/test_random.log" 2>&1
  echo "rc=$?"
  grep -E "FAIL|reproduce" "$OUT/test_random.log" | head -20
  tail -2 "$OUT/test_random.log"
fi
echo "done after $(($(date +%s) - START)) s"
