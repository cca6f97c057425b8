#!/usr/bin/env bash
# Makes the veRL test environment: a virtual environment of its own (verl 0.9.1 pins
# transformers < 5.11; the main environment has 5.17) at ${DUALKV_VERL_VENV:-build/venv-verl}
# with the CPU build of torch 2.13.0, verl==0.9.1 and the pinned packages of
# scripts/verl-requirements.txt (all with --no-deps: verl's full dependency set pulls vllm-era
# extras that are neither needed nor installable on CPU), then builds and installs dualkv into it
# against that environment's torch. Idempotent: a complete environment is reused.
# Usage: bash scripts/setup_verl_env.sh   (prints the environment's python on its last line)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DUALKV_VERL_VENV:-build/venv-verl}"
PY="$VENV/bin/python"
start=$SECONDS
stamp="$VENV/.dualkv-verl-ready"
want="$(cat scripts/verl-requirements.txt scripts/setup_verl_env.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --no-deps "torch==2.13.0"
  "$PY" -m pip install -q --no-deps "verl==0.9.1"
  "$PY" -m pip install -q --no-deps -r scripts/verl-requirements.txt
  # torch's own runtime dependencies (not in the list above, whose pins come from pip freeze)
  "$PY" -m pip install -q "torch==2.13.0"
  "$PY" -c "import verl.workers.engine.fsdp.transformer_impl, transformers, torch; \
print('verl env:', torch.__version__, 'transformers', transformers.__version__)"
  echo "$want" >"$stamp"
fi
# dualkv itself, against this environment's torch (its own build directory)
"$PY" -m pip install -q --no-build-isolation --no-deps -C build-dir=build/verl-wheel .
echo "veRL environment ready in $((SECONDS - start)) s"
echo "$PY"
