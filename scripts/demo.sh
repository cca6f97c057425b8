#!/usr/bin/env bash
# The main job on a fresh machine: installs DualKV into the project's environment (build/venv,
# scripts/setup_env.sh) and runs `python -m dualkv.demo` there on its embedded tiny default (CPU).
# Extra arguments go to the demo (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="$(bash scripts/setup_env.sh)"  # the project's environment, build/venv
"$PY" -m pip install --no-build-isolation --no-deps -q .  # (dependencies: setup_env.sh)
"$PY" -m dualkv.demo "$@"
