#!/usr/bin/env bash
# Runs every test on a fresh machine: makes the project's Python environment (build/venv,
# scripts/setup_env.sh: what is missing is installed there, not into the user's Python), checks
# style and types (scripts/lint.sh), builds the C++ core and its ctest suite, compiles a
# representative subset of the CUDA kernels when nvcc is present (no GPU needed), installs the
# package and runs pytest (GPU tests are skipped, with a reason, without a GPU), then
# tests/python/test_verl.py (and test_bench_verl_update.py, whose veRL batch tests need it) in
# veRL 0.9.1's own environment (scripts/setup_verl_env.sh: build/venv-verl, ~3.5 min when new)
# and the core CPU tests against the newest torch and transformers on the package registries
# (scripts/test_newest.sh: build/venv-newest; DUALKV_SKIP_NEWEST=1 skips them).
# Usage: bash scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
DUALKV_PY="$(bash scripts/setup_env.sh)"
export DUALKV_PY
bash scripts/lint.sh

echo "== C++ core: build and ctest =="
cmake -S . -B build/cpp -G Ninja -DDUALKV_BUILD_TORCH=OFF -DDUALKV_BUILD_TESTS=ON -DDUALKV_CUDA=OFF
cmake --build build/cpp
ctest --test-dir build/cpp --output-on-failure

if command -v nvcc >/dev/null 2>&1 && [ "${DUALKV_SKIP_CUDA_COMPILE:-0}" != 1 ]; then
  echo "== CUDA kernels: compile check (head dim 128, sm_80 and sm_90a; nothing runs) =="
  cmake -S . -B build/cuda-compile -G Ninja -DDUALKV_BUILD_TORCH=OFF -DDUALKV_CUDA=ON \
    -DDUALKV_CUDA_HEAD_DIMS=128 "-DDUALKV_CUDA_ARCHS=80-real;90a-real"
  cmake --build build/cuda-compile --target dualkv_cuda
fi

echo "== Python package: install and pytest =="
"$DUALKV_PY" -m pip install --no-build-isolation --no-deps -q .  # (dependencies: setup_env.sh)
"$DUALKV_PY" -m pytest tests/python -ra -q "$@"

echo "== veRL engine: tests/python/test_verl.py in veRL's own environment (setup_verl_env.sh) =="
VERL_PY="$(bash scripts/setup_verl_env.sh)"
"$VERL_PY" -m pytest tests/python/test_verl.py tests/python/test_bench_verl_update.py -ra -q \
  -p no:cacheprovider

if [ "${DUALKV_SKIP_NEWEST:-0}" != 1 ]; then
  echo "== Newest releases: core CPU tests against the newest torch and transformers (test_newest.sh) =="
  bash scripts/test_newest.sh
fi
