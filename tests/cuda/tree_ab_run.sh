#!/usr/bin/env bash
# The prefix-tree kernels (issue 33) against the binary before them, in one device call:
#   1. depth two unchanged: both binaries check the same random depth-two layouts with the same
#      inputs (--random N --seed S draws no tree case) on every kernel path; each check's printed
#      errors (the GPU's and the baseline's, against the same CPU reference) must agree line for
#      line, so a result that changed shows as a differing line (so would a change of the CPU
#      reference's fp64 rounding, which each binary has its own copy of: same order, not expected);
#   2. the bench of both binaries on the depth-two shapes, default and sm80 paths, interleaved
#      (old, new, old, new on the default path), best of the rounds per shape and path;
#   3. the new binary's branching-rollout forest next to the depth-two micro-batch (same heads).
# Tables last. Correctness of the new binary on trees: device_run.sh test / trees.
#   .out/dualkv_cuda_test       this branch
#   .out/dualkv_cuda_test.base  main before the tree walks (same build options)
#   OUT=... BUDGET=540 bash tests/cuda/tree_ab_run.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.out/tree_ab}"
mkdir -p "$OUT"
source tests/cuda/run_lib.sh
budget 540
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
use_carried_libgomp
NEW=.out/dualkv_cuda_test
OLD=.out/dualkv_cuda_test.base
for b in $NEW $OLD; do $b --no-check >/dev/null 2>&1 || { echo "FAIL: $b does not run"; exit 1; }; done
status=0
# 1. The same depth-two checks with both binaries.
for seed in ${SEEDS:-11 12 13}; do
  step "depth two, seed $seed (both binaries)" 60 || { status=1; break; }
  for b in old new; do
    bin=$NEW
    [ "$b" = old ] && bin=$OLD
    timeout 150 $bin --random "${RANDOM_ROUNDS:-2}" --race 0 --seed "$seed" >"$OUT/random_${b}_$seed.log" 2>&1
    rc=$?
    echo "seed $seed $b: $(tail -1 "$OUT/random_${b}_$seed.log"), rc=$rc"
    [ $rc = 0 ] || status=1
  done
  if diff <(grep -v '^device' "$OUT/random_old_$seed.log") \
    <(grep -v '^device' "$OUT/random_new_$seed.log") >"$OUT/random_diff_$seed.txt"; then
    echo "seed $seed: identical ($(grep -c ' ok$' "$OUT/random_new_$seed.log") checks)"
  else
    echo "FAIL seed $seed: the checks differ ($OUT/random_diff_$seed.txt):"
    head -20 "$OUT/random_diff_$seed.txt"
    status=1
  fi
done
# 2. Depth-two bench, old and new.
k=0
for run in "old default" "new default" "old default" "new default" "old sm80" "new sm80"; do
  set -- $run
  bin=$NEW
  [ "$1" = old ] && bin=$OLD
  k=$((k + 1))
  if step "bench ($1 binary, path $2)" 40; then
    timeout 120 $bin --no-check --bench --bench-reps 5 --path "$2" >"$OUT/bench_${k}_$1.log" 2>&1
  fi
done
# 3. Trees.
if step "bench: tree vs depth two (new binary)" 40; then
  timeout 150 $NEW --no-check --bench --bench-reps 5 --path default --shape tree,32,8,128 \
    --shape multi,32,8,128 --shape tree,16,8,256 --shape multi,16,8,256 >"$OUT/tree_bench.log" 2>&1
fi
echo "done after $(($(date +%s) - START)) s, status $status"
python3 - "$OUT"/bench_*.log <<'PY'
import re, sys
# The bench's table rows: | path shape | fwd ms (TF/s) | bwd | fwd+bwd | bwd det. | fwd+bwd det. | ref |
rows: dict[str, dict[str, list[tuple[float, float, float]]]] = {}
for path in sys.argv[1:]:
    which = "old" if path.endswith("_old.log") else "new"
    for line in open(path):
        c = [x.strip() for x in line.split("|")]
        if len(c) < 7 or not re.match(r"[\d.]+ \(", c[2]):
            continue
        t = [float(c[i].split()[0]) for i in (2, 3, 5)]
        rows.setdefault(c[1], {}).setdefault(which, []).append((t[0], t[1], t[2]))
print("| path shape | fwd ms old / new | bwd ms old / new | bwd deterministic ms old / new |")
print("|---|---|---|---|")
for name, r in rows.items():
    best = {k: [min(x[i] for x in v) for i in range(3)] for k, v in r.items()}
    o, n = best.get("old", [float("nan")] * 3), best.get("new", [float("nan")] * 3)
    print(f"| {name} | " + " | ".join(f"{o[i]:.2f} / {n[i]:.2f}" for i in range(3)) + " |")
PY
grep "^|" "$OUT/tree_bench.log" 2>/dev/null
exit $status
