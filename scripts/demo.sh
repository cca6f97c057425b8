#!/usr/bin/env bash
# The main job on a fresh machine: installs DualKV and runs `python -m dualkv.demo` on its
# embedded tiny default (CPU). Extra arguments go to the demo (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
python3 -m pip install --no-build-isolation -q .
python3 -m dualkv.demo "$@"
