#!/usr/bin/env bash
# Nsight Compute profiles of FA4's and DualKV's attention kernels side by side on plain causal
# attention (issue 32), one device call: for each shape P,Hq,Hkv,D and each method
# (PROFILE_METHODS, default "fa4-rows dualkv": bench/attention.py's runners) one forward +
# backward after warm-up under `ncu --set full` (the profiler range of bench/profile_anchor.py),
# then
#   $OUT/profile_summary.txt  per shape the kernels side by side (src/cuda/tools/ncu_summary.py
#                             --table: time, issue slots, tensor pipe, achieved occupancy,
#                             registers, shared memory, launch, top stalls; totals per role),
#                             then each kernel's headline metrics, stall reasons and hottest
#                             SASS lines
#   $OUT/<shape>_<method>.ncu-rep.gz  the reports;  $OUT/profile.log  the runs' output
# Needs the package built (scripts/gpu_check.sh build) and, for FA4, the PYTHONPATH of
# ../shared/tools/cute_anchors_bundle.sh's header. Each profile has its own timeout and the script
# a deadline (BUDGET seconds, default 450), so what was profiled comes back when a step runs long.
#   OUT=... bash bench/profile_anchor.sh 8192,16,8,128 8192,16,16,64
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-.out/profile_anchor}"
mkdir -p "$OUT"
source tests/cuda/run_lib.sh
budget 450
# FA4 keeps its compiled kernels on disk (/tmp): a warm machine compiles them once
export PYTHONUNBUFFERED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED="${FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED:-1}"
shapes=("$@")
[ ${#shapes[@]} -eq 0 ] && shapes=(8192,16,8,128 8192,16,16,64)
read -r -a methods <<<"${PROFILE_METHODS:-fa4-rows dualkv}"
summary="$OUT/profile_summary.txt" log="$OUT/profile.log" details=/tmp/profile_details.txt
: >"$summary"
: >"$log"
: >"$details"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  ncu --version | tail -1
} | tee -a "$summary"
python3 -c "import dualkv" || { echo "dualkv is not installed: run scripts/gpu_check.sh build"; exit 1; }
for shape in "${shapes[@]}"; do
  IFS=, read -r p hq hkv d <<<"$shape"
  tag="p${p}_h${hq}-${hkv}_d${d}"
  tables=()
  for m in "${methods[@]}"; do
    step "ncu --set full: $m, plain causal $shape" 60 || { status=1; continue; }
    rep="/tmp/prof_${tag}_$m"
    rm -f "$rep.ncu-rep"
    t=$(($(left) - 20))
    [ "$t" -gt 300 ] && t=300
    echo "### $m, plain causal $shape" >>"$log"
    timeout "$t" ncu --profile-from-start off --clock-control none --set full --import-source yes \
      -f -o "$rep" python3 bench/profile_anchor.py --method "$m" --shape "$shape" >>"$log" 2>&1
    echo "rc=$?"
    if [ ! -f "$rep.ncu-rep" ]; then
      tail -4 "$log"
      status=1
      continue
    fi
    timeout 60 ncu --import "$rep.ncu-rep" --page raw --csv --print-units base >"$rep.raw.csv" 2>>"$log"
    timeout 90 ncu --import "$rep.ncu-rep" --page source --csv --print-source sass \
      >"$rep.source.csv" 2>>"$log"
    {
      echo "=== $m, plain causal $shape"
      python3 src/cuda/tools/ncu_summary.py "$rep.raw.csv" "$rep.source.csv"
    } >>"$details" 2>&1
    gzip -c "$rep.ncu-rep" >"$OUT/${tag}_$m.ncu-rep.gz"
    ls -l "$OUT/${tag}_$m.ncu-rep.gz" | awk '{print $5, $NF}'
    tables+=("$m=$rep.raw.csv")
  done
  if [ ${#tables[@]} -gt 0 ]; then
    {
      echo
      echo "== plain causal P=$p Hq=$hq Hkv=$hkv D=$d, forward + backward (ncu --set full, clocks not locked)"
      python3 src/cuda/tools/ncu_summary.py --table "${tables[@]}"
    } | tee -a "$summary"
  fi
done
{
  echo
  echo "== per kernel: headline metrics, stall reasons, hottest SASS lines"
  cat "$details"
} >>"$summary"
echo "done after $(($(date +%s) - START)) s, status $status"
exit $status
