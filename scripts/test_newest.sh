#!/usr/bin/env bash
# The core CPU tests (op, layout, packing, losses, log-probs, HF backend, compile, errors; not the
# guard-rail file test_edges.py, slow with its subprocesses, to keep CI short) against
# the newest releases of torch and transformers on the package registries, in an environment of
# their own (${DUALKV_NEWEST_VENV:-build/venv-newest}, isolated from the user's packages). Run by
# test.sh (and so by CI) after the pinned suite: pyproject.toml's version ranges end at the newest
# releases these tests passed on, and a note says when a newer one is out of range.
# - PyPI's Linux torch is a CUDA build that imports only with its CUDA libraries (the nvidia-*
#   wheels: about 3 GB to download, 5.6 GB in the environment at torch 2.15); they are installed
#   too. The op is built without DualKV's CUDA library (nothing CUDA runs here).
# - Constraint files in pip's configuration are set aside for this environment's pip
#   (PIP_CONSTRAINT=/dev/null): one can cap torch below its newest release.
# - Reused: each run upgrades the environment to the newest releases (only the index is asked
#   when nothing changed) and rebuilds the op incrementally (build/newest-wheel).
# Usage: bash scripts/test_newest.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DUALKV_NEWEST_VENV:-build/venv-newest}"
PY="$VENV/bin/python"
start=$SECONDS
export PIP_CONSTRAINT=/dev/null
# (this machine's pip configuration warns about absent local index folders: filtered)
pipq() { "$PY" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
[ -x "$PY" ] || "${DUALKV_PYTHON:-python3}" -m venv "$VENV"
pipq install -q --upgrade torch transformers pytest numpy "scikit-build-core>=0.10"
CMAKE_ARGS="-DDUALKV_CUDA=OFF" pipq install -q --no-build-isolation --no-deps \
  -C build-dir=build/newest-wheel .
echo "newest releases ready in $((SECONDS - start)) s"
"$PY" - <<'EOF'
from importlib.metadata import requires, version

from packaging.requirements import Requirement

for req in map(Requirement, requires("dualkv") or []):
    if req.name in ("torch", "transformers"):
        have = version(req.name)
        note = "" if req.specifier.contains(have) else "  NOTE: outside pyproject.toml's range"
        print(f"newest {req.name} {have} (pyproject.toml: {req.specifier}){note}")
EOF
"$PY" -m pytest -ra -q -p no:cacheprovider "$@" \
  tests/python/test_attention.py tests/python/test_layout.py tests/python/test_packing.py \
  tests/python/test_losses.py tests/python/test_logprobs.py tests/python/test_transformers.py \
  tests/python/test_compile.py tests/python/test_errors.py
