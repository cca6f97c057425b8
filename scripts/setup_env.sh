#!/usr/bin/env bash
# Makes (once) and reuses the project's Python environment for test.sh, demo.sh and lint.sh: a
# virtual environment at ${DUALKV_VENV:-build/venv} with the build and test dependencies at the
# versions the project is tested on. Nothing is installed into the Python that runs the scripts
# (${DUALKV_PYTHON:-python3}): the environment is made by it and sees its packages after its own
# (a .pth file adds that Python's site-packages folders: unlike --system-site-packages, this also
# covers a Python that is itself a virtual environment). So an installed torch (a CUDA build, say)
# is used as is, and the pinned packages below shadow, never replace, other versions the user has.
# Without an installed torch the environment gets $DUALKV_TORCH_PIN (default torch==2.13.0). It is
# made anew when that Python, its site folders, its torch or the pins change. Debian packages
# (cmake, ninja, g++, gtest) are installed with apt-get when running as root. veRL's tests have an
# environment of their own (setup_verl_env.sh), and so do the newest releases (test_newest.sh).
# Usage: DUALKV_PY="$(bash scripts/setup_env.sh)"   (stdout: the environment's python; the rest
# goes to stderr)
set -euo pipefail
cd "$(dirname "$0")/.."
exec 3>&1 1>&2  # everything but the final line to stderr
torch_pin="${DUALKV_TORCH_PIN:-torch==2.13.0}"
# trl 1.16.0 and its trainer stack for tests/python/test_trl.py; pip's resolution keeps the torch
# and transformers above (checked with --dry-run).
# matplotlib: the GRPO learning run's plot (bench/grpo_learning.py, test_grpo_learning).
pins=("scikit-build-core>=0.10" pytest numpy "transformers==5.17.0"
  "trl==1.16.0" "accelerate==1.15.0" "datasets==5.2.0" "matplotlib==3.11.2")
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  need=()
  command -v cmake >/dev/null 2>&1 || need+=(cmake)
  command -v ninja >/dev/null 2>&1 || need+=(ninja-build)
  command -v g++ >/dev/null 2>&1 || need+=(g++)
  "${DUALKV_PYTHON:-python3}" -c "import ensurepip" 2>/dev/null || need+=(python3-venv)
  [ -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ] ||
    [ -n "$(find /usr/lib -name GTestConfig.cmake 2>/dev/null | head -1)" ] || need+=(libgtest-dev)
  if [ ${#need[@]} -gt 0 ]; then
    echo "setup_env: installing Debian packages: ${need[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
  fi
fi
VENV="${DUALKV_VENV:-build/venv}"
PY="$VENV/bin/python"
stamp="$VENV/.dualkv-ready"
# The base Python's executable, site folders and torch: with the pins, what the environment is.
mapfile -t base < <("${DUALKV_PYTHON:-python3}" -c 'import importlib.util, sys
t = importlib.util.find_spec("torch")
print(sys.executable)
print(repr([p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]))
print(t.origin if t else "")')
want="$(printf '%s\n' "${base[@]}" "$torch_pin" "${pins[@]}" | sha256sum | cut -c1-16)"
if [ ! -x "$PY" ] || [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  if [ -e "$VENV" ] && [ ! -f "$stamp" ]; then
    echo "setup_env: $VENV exists and was not made by this script: remove it, or set DUALKV_VENV"
    exit 1
  fi
  new=("${pins[@]}")
  [ -n "${base[2]}" ] || new=("$torch_pin" "${new[@]}")
  echo "setup_env: making the project's environment $VENV on ${base[0]}, whose packages it sees" \
    "(torch: ${base[2]:-none}); installing into it (not into ${base[0]}) what the build and tests" \
    "need, where missing: ${new[*]}"
  rm -rf "$VENV"
  "${base[0]}" -m venv "$VENV"
  "$PY" -c 'import sys, sysconfig, pathlib
line = f"import site; list(map(site.addsitedir, {sys.argv[1]}))\n"
pathlib.Path(sysconfig.get_paths()["purelib"], "_dualkv_base_site.pth").write_text(line)' "${base[1]}"
  # (this machine's pip configuration warns about absent local index folders: filtered)
  "$PY" -m pip install -q "${new[@]}" 2>&1 | { grep -v "^WARNING: Location" || true; }
  echo "$want" >"$stamp"
fi
echo "$PY" >&3
