#!/usr/bin/env bash
# One device call of full Nsight Compute profiles (stall reasons, hottest SASS lines): builds the
# standalone binary (all head dims, sm_90a), then for each spec NAME:KERNEL_REGEX:PATH:SHAPE
# profiles the first launch of the kernel at that bench shape and writes
# $OUT/NAME.txt (tools/ncu_summary.py of its raw and source pages) and $OUT/NAME.csv.gz (the source page,
# for reading more lines here). Each profile has its own timeout; the script a deadline.
#   PROF_DIMS="64;128" (default all four) limits the build's head dims.
#   OUT=... bash tests/cuda/profile_run.sh d512fwd:fwd_d512_cluster:default:16,8192,1024,32,4,512 ...
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-.out/profile}"
mkdir -p "$OUT"
source tests/cuda/run_lib.sh
budget 560
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
step build 120 || exit 1
build_bin . build/prof "${PROF_DIMS:-64;128;256;512}" 240 || exit 1
R=/tmp/prof.ncu-rep
for spec in "$@"; do
  IFS=: read -r name kern path shape <<<"$spec"
  step "ncu --set full: $name ($kern, $path, $shape)" 60 || { status=1; continue; }
  rm -f "$R"
  timeout 150 ncu --clock-control none --set full --import-source yes -k "regex:$kern" \
    --launch-count 1 -f -o "${R%.ncu-rep}" $BIN --no-check --bench --bench-reps 1 --path "$path" \
    --shape "$shape" >/tmp/prof.log 2>&1
  echo "rc=$?"; tail -2 /tmp/prof.log
  [ -f "$R" ] || { status=1; continue; }
  timeout 30 ncu --import "$R" --page raw --csv >/tmp/raw.csv 2>/dev/null
  timeout 60 ncu --import "$R" --page source --csv --print-source sass >/tmp/source.csv 2>/dev/null
  python3 src/cuda/tools/ncu_summary.py /tmp/raw.csv /tmp/source.csv >"$OUT/$name.txt" 2>&1
  gzip -c /tmp/source.csv >"$OUT/$name.csv.gz"
  head -45 "$OUT/$name.txt" | cut -c1-160
done
echo "done after $(($(date +%s) - START)) s, status $status"
exit $status
