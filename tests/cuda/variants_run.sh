#!/usr/bin/env bash
# One device call for the kernel variants (the A/B paths of D = 512) and an A/B of the
# default path: builds this tree and an older one (OLD_TREE, copied into an ignored folder and
# carried), checks the variants (matrix + race, memcheck on --small), checks this tree's default
# path (quick matrix + race), then benches the default path of both trees and each variant beside
# this tree's default. Every step has a timeout; a hung variant skips its bench. Logs: $OUT (at
# most 8 files).
#   OUT=... bash tests/cuda/variants_run.sh OLD_TREE
#   D512_PATHS: the variant paths checked and benched (default below); KEY_PATHS:
#   the dK/dV CTA orders (DUALKV_BWD_KEY_ORDER), checked (quick matrix + race) and benched at the
#   D = 64/128 shapes beside the default, with ncu's L2 hit rate and DRAM bytes of the fused dK/dV
#   kernel at (32, 4096, 2048) for the default and the first of them.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.out/variants}"
mkdir -p "$OUT"
OLD_TREE=${1:?usage: variants_run.sh OLD_TREE}
D512_PATHS=${D512_PATHS-sm90-d512-sm80}
KEY_PATHS=${KEY_PATHS-key-chunk32,key-chunk16,key-chunk64}
DIMS="64;128;256;512"
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
source tests/cuda/run_lib.sh
# Both trees at once, 8 jobs each (build_bin prints the log's tail if one fails).
build_bin . build/var-new "$DIMS" 300 8 & b1=$!
build_bin "$OLD_TREE" build/var-old "$DIMS" 300 8 & b2=$!
wait $b1 || exit 1
wait $b2 || exit 1
NEW=build/var-new/tests/cuda/dualkv_cuda_test
OLD=build/var-old/tests/cuda/dualkv_cuda_test
echo "builds $(($(date +%s) - T0)) s"
BIN=$NEW
: >"$OUT/test.log"
: >"$OUT/summary.txt"
# An empty D512_PATHS / KEY_PATHS skips that family's checks and benches.
[ -n "$D512_PATHS" ] && check d512 100 --path "$D512_PATHS" --race 10
check default-quick 60 --path default --quick --race 5
[ -n "$KEY_PATHS" ] && check key-order 90 --path "$KEY_PATHS" --quick --race 5
memcheck default default
case "$hung" in *d512*) ;; *) for p in ${D512_PATHS//,/ }; do memcheck "$p" "$p"; done ;; esac
rm -f "$OUT/one.log"
D128=(--shape 16,8192,1024,32,8,128 --shape 32,4096,2048,32,8,128 --shape 8,16384,2048,32,8,128
  --shape 16,8192,1024,16,8,128 --shape 16,2048,2048,16,16,64)
# Both trees' default path (and the separate dQ pass) at every head dim.
for b in OLD NEW; do
  timeout 90 "${!b}" --no-check --bench --bench-reps 5 --path default,sm90-sepdq "${D128[@]}" \
    --shape 16,8192,1024,16,8,256 --shape 16,8192,1024,32,4,512 >"$OUT/bench_$b.log" 2>&1
  echo "bench $b rc=$?"
done
{
  case "$hung" in *d512*) ;; *)
    [ -n "$D512_PATHS" ] && timeout 90 $NEW --no-check --bench --bench-reps 3 \
      --path "default,$D512_PATHS" --shape 16,8192,1024,32,4,512 --shape 8,16384,2048,32,4,512 ;; esac
  case "$hung" in *key-order*) ;; *)
    [ -n "$KEY_PATHS" ] && timeout 90 $NEW --no-check --bench --bench-reps 5 \
      --path "default,$KEY_PATHS" "${D128[@]}" ;; esac
} >"$OUT/bench_variants.log" 2>&1
[ -n "$KEY_PATHS" ] && case "$hung" in *key-order*) ;; *)
  for p in default "${KEY_PATHS%%,*}"; do
    timeout 60 ncu --clock-control none -k regex:dkdv_ws_kernel_sm90 --launch-count 1 --metrics \
      gpu__time_duration.sum,lts__t_sector_hit_rate.pct,dram__bytes_read.sum,dram__bytes_write.sum \
      $NEW --no-check --bench --bench-reps 1 --path "$p" --shape 32,4096,2048,32,8,128 2>&1 |
      grep -E "duration|hit_rate|dram__bytes" | sed "s/^/$p /"
  done >"$OUT/ncu_l2.log" 2>&1 ;; esac
echo "total $(($(date +%s) - T0)) s, status $status"
cat "$OUT/summary.txt"
cat "$OUT/ncu_l2.log" 2>/dev/null
for f in bench_OLD bench_NEW bench_variants; do
  [ -f "$OUT/$f.log" ] || continue
  echo "## $f"
  grep "^|" "$OUT/$f.log" | grep -v "^|---" | cut -c1-230
done
exit $status
