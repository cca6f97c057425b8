#!/usr/bin/env bash
# The GPU machine's job, one call: build the package (CUDA library included) against the
# machine's torch, run the GPU tests on each kernel path, the standalone CUDA tests and
# sanitizers, then the benchmarks.
# Logs and results go to $OUT. Usage: bash scripts/gpu_check.sh [build|test|sanitize|bench|model]...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-.out/gpu}"
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(build test sanitize bench)
export PYTHONUNBUFFERED=1
status=0
for step in "${steps[@]}"; do
  case "$step" in
  build)
    echo "== build =="
    # Built here from source: objects compiled elsewhere (another gcc/libstdc++) crashed in
    # the op's error path when linked into the torch extension.
    CMAKE_ARGS="-DDUALKV_CUDA=ON" CMAKE_BUILD_PARALLEL_LEVEL=16 \
      python3 -m pip install --no-build-isolation --no-deps -q . >"$OUT/build.log" 2>&1 ||
      { tail -40 "$OUT/build.log"; exit 1; }
    python3 -c "import torch, dualkv; print('dualkv', dualkv.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"
    ;;
  test)
    # Each kernel path: default (warp-specialised on sm_90), the synchronous wgmma one, sm_80.
    # A hung kernel ends the run after 300 s per test where pytest-timeout is installed.
    tmo=()
    python3 -c "import pytest_timeout" 2>/dev/null && tmo=(--timeout=300 --timeout-method=thread)
    for path in default DUALKV_SM90_WS=0 DUALKV_FORCE_SM80=1; do
      echo "== GPU tests ($path) =="
      log="$OUT/pytest_${path%%=*}.log"
      envs=()
      [ "$path" = default ] || envs=("$path")
      (cd /tmp && env "${envs[@]}" python3 -m pytest "$OLDPWD/tests/python" -q --maxfail=20 -k "cuda or gpu" \
        -p no:cacheprovider "${tmo[@]}" >"$log" 2>&1); rc=$?
      tail -1 "$log"; grep -E "^(FAILED|ERROR)" "$log" | head -20
      grep -q "kernels cannot run" "$log" && { echo "FAIL: the warp-specialised kernels fell back"; rc=1; }
      [ $rc = 0 ] || status=1
    done
    ;;
  sanitize)
    # The standalone CUDA test binary (built on the dev machine into .out/, carried along):
    # full case matrix on every kernel path, races, compute-sanitizer on small cases.
    if [ -x .out/dualkv_cuda_test ]; then
      OUT="$OUT" bash tests/cuda/device_run.sh test sanitize || status=1
    else
      echo "no .out/dualkv_cuda_test: build it first (see src/cuda/NOTES.md)"
    fi
    ;;
  model)
    echo "== model-level GRPO step benchmark (issue 4) =="
    python3 bench/model_step.py --presets "${MODEL_PRESETS:-1.7b}" 2>&1 |
      tee "$OUT/model_step.log" | tail -20
    ;;
  bench)
    echo "== benchmark =="
    python3 bench/attention.py --out "$OUT" --repeats "${BENCH_REPEATS:-10}" 2>&1 |
      tee "$OUT/bench.log" | tail -32
    ;;
  esac
done
exit $status
