#!/usr/bin/env bash
# Prepares what bench/verl_update.py needs on the GPU machine (Python 3.12, torch 2.11,
# transformers 5.17 -- verl 0.9.1 imports and runs with 5.17 although its metadata pins < 5.11)
# and the machine lacks, in one folder to carry: .whl-verl/ (added to .git/info/exclude).
#   .whl-verl/*.whl             verl 0.9.1 and the small packages it imports (~4 MiB)
#   .whl-verl/ray-site.tar.xz   ray 2.60.0's wheel contents, xz-compressed, without its Java jars
#                               and dashboard web bundle (the wheel is 76 MiB, over the 64 MiB a
#                               call carries)
# Unpacked there by the command printed at the end. Takes ~5 min here (xz on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl-verl/' .git/info/exclude 2>/dev/null || echo '/.whl-verl/' >>.git/info/exclude
rm -rf .whl-verl /tmp/verl-ray && mkdir -p .whl-verl /tmp/verl-ray/site
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pkgs=(verl==0.9.1 tensordict==0.10.0 hydra-core==1.3.8 omegaconf==2.3.1 codetiming==1.4.0
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pyvers==0.1.0 orjson==3.13.0
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  lazy-importer==0.1.0)
python3 -m pip download -q --no-deps "${plat[@]}" -d .whl-verl "${pkgs[@]}"
# antlr4-python3-runtime 4.9.3 (hydra/omegaconf) is a source release: a pure-Python wheel from it
python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl-verl antlr4-python3-runtime==4.9.3
python3 -m pip download -q --no-deps "${plat[@]}" -d /tmp/verl-ray ray==2.60.0
unzip -q /tmp/verl-ray/ray-*.whl -d /tmp/verl-ray/site
# without ray's Java worker jars and its dashboard's web bundle (not used by import ray; the
# benchmark never starts a ray cluster): ~15 MiB less to carry
tar -C /tmp/verl-ray/site --exclude=./ray/jars --exclude=./ray/dashboard/client -cf - . |
  xz -9 -T0 >.whl-verl/ray-site.tar.xz
rm -rf /tmp/verl-ray
du -sh .whl-verl
cat <<'EOF'
On the GPU machine (carry [".whl-verl"]), begin the command with:
  mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl-verl/ray-site.tar.xz &&
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl-verl/*.whl && export PYTHONPATH=/tmp/site || exit;
EOF
