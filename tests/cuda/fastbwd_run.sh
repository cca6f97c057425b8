#!/usr/bin/env bash
# The sm_90a backward at D = 64/128, fused dQ (the default) against the separate dQ pass
# (DUALKV_FUSED_DQ=0, --path sm90-sepdq; what deterministic=True runs), in one device call: the
# backward timed on both paths at the reference shapes (each row also times deterministic=True),
# the correctness matrix and race test on both, ncu kernel durations of both, a full ncu profile
# (stall reasons, hottest SASS lines) of the fused dK/dV kernel, and random layouts. Every step
# has its own timeout and the whole script a deadline (BUDGET seconds), so what was measured comes
# back even when a step runs long. The binary: .out/dualkv_cuda_test if present (built on the dev
# machine, libgomp in .out/lib), else it is built here with
#   -DDUALKV_CUDA_HEAD_DIMS=128;64 -DDUALKV_CUDA_ARCHS=90a.
#   OUT=... BUDGET=300 bash tests/cuda/fastbwd_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.out/fastbwd}"
mkdir -p "$OUT"
source tests/cuda/run_lib.sh
budget 300
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
use_carried_libgomp
BIN=.out/dualkv_cuda_test
if ! $BIN --no-check >/dev/null 2>&1; then
  step build 150 || exit 1
  build_bin . build/dev "128;64" 240 || exit 1
fi
REF=(--shape 16,8192,1024,32,8,128)
PATHS=(default sm90-sepdq)

# 1. The backward on both paths (bwd and bwd deterministic columns), reference shapes.
if step bench 40; then
  for p in "${PATHS[@]}"; do
    timeout 90 $BIN --no-check --bench --bench-reps 5 --path "$p" \
      "${REF[@]}" --shape 32,4096,2048,32,8,128 --shape 8,16384,2048,32,8,128 \
      --shape 16,8192,1024,16,8,128 --shape 16,2048,2048,16,16,64 >"$OUT/bench_$p.log" 2>&1
    echo "rc=$?"
    grep -q "kernels cannot run" "$OUT/bench_$p.log" && echo "FAIL: fell back"
    grep "^|" "$OUT/bench_$p.log"
  done
fi

# 2. Correctness: the matrix and race x 10 on both paths (fused: dk/dv, out, lse bitwise).
for p in "${PATHS[@]}"; do
  if step "correctness (matrix + race 10, path $p)" 60; then
    timeout 120 $BIN --path "$p" --race 10 >"$OUT/test_$p.log" 2>&1
    echo "rc=$?"
    grep -E "FAIL|reproduce" "$OUT/test_$p.log" | head -20
    tail -2 "$OUT/test_$p.log"
  fi
done

# 3. ncu kernel durations (backward calls of the bench at the first shape), both paths.
for p in "${PATHS[@]}"; do
  if step "ncu durations, path $p" 40; then
    timeout 60 ncu --csv --clock-control none --metrics gpu__time_duration.sum \
      -k "regex:dkdv_ws|dq_ws|dq_convert|bwd_pre" $BIN --no-check --bench --bench-reps 1 \
      --path "$p" "${REF[@]}" >"$OUT/ncu_durations_$p.csv" 2>&1
    echo "rc=$?"
    python3 - "$OUT/ncu_durations_$p.csv" <<'PY'
import csv, re, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
if rows:
    h = {n: i for i, n in enumerate(rows[0])}
    for r in rows[1:]:
        k = re.sub(r"\(dualkv::cuda::detail::[^)]*\)|dualkv::cuda::detail::", "", r[h["Kernel Name"]])
        print(f"  {k[:90]:90s} {r[h['Metric Value']]:>10s} {r[h['Metric Unit']]}")
PY
  fi
done

# 4. A full profile of the fused dK/dV kernel.
if step "ncu --set full, fused dK/dV kernel" 75; then
  timeout 120 ncu --clock-control none --set full -k regex:dkdv_ws_kernel_sm90 --launch-count 1 \
    -f -o "$OUT/ncu_fused" $BIN --no-check --bench --bench-reps 1 --path default \
    "${REF[@]}" >"$OUT/ncu_fused.log" 2>&1
  echo "rc=$?"
  tail -3 "$OUT/ncu_fused.log"
  R="$OUT/ncu_fused.ncu-rep"
  if [ -f "$R" ]; then
    timeout 30 ncu --import "$R" --page raw --csv >"$OUT/ncu_fused_raw.csv" 2>>"$OUT/ncu_import.err"
    timeout 40 ncu --import "$R" --page source --csv --print-source sass \
      >"$OUT/ncu_fused_source.csv" 2>>"$OUT/ncu_import.err"
    python3 src/cuda/tools/ncu_summary.py "$OUT/ncu_fused_raw.csv" \
      "$OUT/ncu_fused_source.csv" >"$OUT/ncu_fused_summary.txt" 2>&1
    head -60 "$OUT/ncu_fused_summary.txt"
  fi
fi

# 5. With time left: random layouts (D = 64/128 of them run here), default path.
if step "correctness (random layouts, default path)" 40; then
  timeout $(($(left) - 10)) $BIN --path default --race 0 --random 20 \
    >"$OUT/test_random.log" 2>&1
  echo "rc=$?"
  grep -E "FAIL|reproduce" "$OUT/test_random.log" | head -20
  tail -2 "$OUT/test_random.log"
fi
echo "done after $(($(date +%s) - START)) s"
