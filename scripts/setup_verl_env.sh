#!/usr/bin/env bash
# Makes the veRL test environment: a virtual environment of its own (verl 0.9.1 pins
# transformers < 5.11; the main environment has 5.17) at ${DUALKV_VERL_VENV:-build/venv-verl}
# with the CPU build of torch 2.13.0, verl==0.9.1 and the pinned packages of
# scripts/verl-requirements.txt (all with --no-deps: verl's full dependency set pulls vllm-era
# extras that are neither needed nor installable on CPU), then builds and installs dualkv into it
# against that environment's torch. Idempotent: a complete environment is reused.
# Usage: VERL_PY="$(bash scripts/setup_verl_env.sh)"   (stdout: the environment's python; the
# rest goes to stderr)
set -euo pipefail
cd "$(dirname "$0")/.."
exec 3>&1 1>&2  # everything but the final line to stderr
VENV="${DUALKV_VERL_VENV:-build/venv-verl}"
PY="$VENV/bin/python"
start=$SECONDS
stamp="$VENV/.dualkv-verl-ready"
pins="torch==2.13.0 verl==0.9.1"
want="$( (echo "$pins"; cat scripts/verl-requirements.txt) | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  rm -rf "$VENV"
  "${DUALKV_PYTHON:-python3}" -m venv "$VENV"
  # (this machine's pip configuration warns about absent local index folders: filtered)
  pipq() { "$PY" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
  # shellcheck disable=SC2086
  pipq install -q --no-deps $pins
  pipq install -q --no-deps -r scripts/verl-requirements.txt
  "$PY" -c "import verl.workers.engine.fsdp.transformer_impl, transformers, torch; \
print('verl env:', torch.__version__, 'transformers', transformers.__version__)"
  echo "$want" >"$stamp"
fi
# dualkv itself, against this environment's torch. When the project's environment (DUALKV_PY,
# set by scripts/test.sh: build/venv) has the very same torch build (torch 2.13.0+cpu in CI), the
# wheel is made from its build directory (test.sh has just compiled it: seconds); otherwise it is
# compiled for this environment.
main_torch=""
[ -z "${DUALKV_PY:-}" ] ||
  main_torch="$("$DUALKV_PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
venv_torch="$("$PY" -c 'import torch; print(torch.__version__)')"
if [ "$main_torch" = "$venv_torch" ]; then
  rm -rf build/verl-wheelhouse
  "$DUALKV_PY" -m pip wheel -q --no-build-isolation --no-deps -w build/verl-wheelhouse . 2>&1 |
    { grep -v "^WARNING: Location" || true; }
  "$PY" -m pip install -q --no-deps --force-reinstall build/verl-wheelhouse/dualkv-*.whl 2>&1 |
    { grep -v "^WARNING: Location" || true; }
else
  "$PY" -m pip install -q --no-build-isolation --no-deps -C build-dir=build/verl-wheel . 2>&1 |
    { grep -v "^WARNING: Location" || true; }
fi
echo "veRL environment ready in $((SECONDS - start)) s"
echo "$PY" >&3
