# Installs the build and test dependencies that are missing (sourced by test.sh and demo.sh).
# Debian packages when running as root with apt-get; Python packages with pip. An installed
# torch is kept (CUDA builds included); otherwise the CPU build pinned below is installed.
DUALKV_TORCH_PIN="${DUALKV_TORCH_PIN:-torch==2.13.0}"
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  need=()
  command -v cmake >/dev/null 2>&1 || need+=(cmake)
  command -v ninja >/dev/null 2>&1 || need+=(ninja-build)
  command -v g++ >/dev/null 2>&1 || need+=(g++)
  [ -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ] || \
    [ -n "$(find /usr/lib -name GTestConfig.cmake 2>/dev/null | head -1)" ] || need+=(libgtest-dev)
  if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
  fi
fi
python3 -c "import torch" 2>/dev/null || python3 -m pip install -q "$DUALKV_TORCH_PIN"
python3 -m pip install -q "scikit-build-core>=0.10" pytest numpy "transformers==5.17.0"
# TRL integration tests (tests/python/test_trl.py): trl 1.16.0 and its trainer stack; pip's
# resolution keeps the torch and transformers above (checked with --dry-run).
python3 -m pip install -q "trl==1.16.0" "accelerate==1.15.0" "datasets==5.2.0"
# The GRPO learning run's plot (tests/python/test_grpo_learning.py)
python3 -m pip install -q "matplotlib==3.11.2"
