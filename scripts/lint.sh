#!/usr/bin/env bash
# Style and type checks (run first by test.sh): ruff lint and format, mypy on the package,
# clang-format on the C++/CUDA sources. Pinned versions, so every machine formats alike, installed
# into the project's environment (build/venv, scripts/setup_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${DUALKV_PY:-$(bash scripts/setup_env.sh)}"
"$PY" -m pip install -q "ruff==0.17.6" "mypy==2.4.1" "clang-format==23.1.5" 2>&1 |
  { grep -v "^WARNING: Location" || true; }
echo "== lint: ruff, mypy, clang-format =="
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m mypy  # files and options: pyproject.toml [tool.mypy]
find include src tests \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) -print0 |
  xargs -0 "$PY" -c "import clang_format, sys; sys.exit(clang_format.clang_format())" \
    --dry-run -Werror
echo "lint: clean"
