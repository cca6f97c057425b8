#!/usr/bin/env bash
# Downloads the wheels bench/verl_update.py needs on the GPU machine (Python 3.12, torch 2.11,
# transformers 5.17: verl 0.9.1 imports and runs with it although its metadata pins < 5.11) that
# the machine lacks, into two folders of at most ~42 MiB each (the device tool carries 64 MiB a
# call; ray's wheel alone is 76 MiB, so it is split in two and joined there):
#   .whl-verl-a/  every small wheel + ray's first half     (carry it in one call)
#   .whl-verl-b/  ray's second half                        (carry it in the next call)
# Both folders are added to .git/info/exclude. Run here, in the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl-verl-a/' .git/info/exclude 2>/dev/null || echo '/.whl-verl-a/' >>.git/info/exclude
grep -qx '/.whl-verl-b/' .git/info/exclude 2>/dev/null || echo '/.whl-verl-b/' >>.git/info/exclude
rm -rf .whl-verl-a .whl-verl-b /tmp/verl-ray && mkdir -p .whl-verl-a .whl-verl-b /tmp/verl-ray
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pkgs=(verl==0.9.1 tensordict==0.10.0 hydra-core==1.3.8 omegaconf==2.3.1 codetiming==1.4.0
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pyvers==0.1.0 orjson==3.13.0
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  lazy-importer==0.1.0)
python3 -m pip download -q --no-deps "${plat[@]}" -d .whl-verl-a "${pkgs[@]}"
# antlr4-python3-runtime 4.9.3 (hydra/omegaconf) is a source release: a pure-Python wheel from it
python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl-verl-a antlr4-python3-runtime==4.9.3
python3 -m pip download -q --no-deps "${plat[@]}" -d /tmp/verl-ray ray==2.60.0
ray=$(ls /tmp/verl-ray/ray-*.whl)
basename "$ray" >.whl-verl-a/RAY_WHEEL_NAME
split -n 2 -d "$ray" /tmp/verl-ray/part-
mv /tmp/verl-ray/part-00 .whl-verl-a/ray.part-00
mv /tmp/verl-ray/part-01 .whl-verl-b/ray.part-01
du -sh .whl-verl-a .whl-verl-b
