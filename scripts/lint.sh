#!/usr/bin/env bash
# Style and type checks (run first by test.sh): ruff lint and format, mypy on the package,
# clang-format on the C++/CUDA sources. Pinned versions, so every machine formats alike.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q "ruff==0.17.6" "mypy==2.4.1" "clang-format==23.1.5"
echo "== lint: ruff, mypy, clang-format =="
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m mypy  # files and options: pyproject.toml [tool.mypy]
find include src tests \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) -print0 |
  xargs -0 python3 -c "import clang_format, sys; sys.exit(clang_format.clang_format())" \
    --dry-run -Werror
echo "lint: clean"
