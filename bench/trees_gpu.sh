#!/usr/bin/env bash
# Issue 33's tree benchmarks on the GPU machine (one H200), step by step; logs, JSON and tables
# go to $OUT, the short tables are printed last. A machine is given back 30 s after a call, so
# every call starts with `build` (DualKV for head dim 128 on sm_90a only: what these runs use).
# Three device calls, each under 8 minutes (estimates, not measured):
#   1. OUT=$OUT bash bench/trees_gpu.sh build attention          # ~1.5 + ~5 min
#   2. OUT=$OUT bash bench/trees_gpu.sh build model minshared     # ~1.5 + ~2.5 + ~2 min
#   3. OUT=$OUT bash bench/trees_gpu.sh build verl                # ~1.5 + ~5 min; carry .whl-verl
# (`test` runs the tree kernels' GPU tests at head dim 128 first, ~1 min, if wanted.)
#   build      pip install the package with the CUDA kernels (D = 128, sm_90a)
#   test       tests/python/test_tree.py's GPU cases at D = 128 (the tree kernels' first run)
#   attention  bench/attention.py: the three tree batches (dualkv, flex with the tree mask, FA4
#              where installed and cuDNN SDPA on the rows), then DualKV on their depth-two twins,
#              then the comparisons (tree vs twin TF/s, speed-ups; attention.py --summary)
#   deep       bench/attention.py: the long-horizon batch with its segments as listed (depth 25)
#              and its twin, DualKV alone: what each ancestor of the walk costs
#   model      bench/model_step.py, Qwen3-1.7B, the agentic tree batch (one task, 22 rows): rows
#              (SDPA) vs flex (tree mask) vs DualKV on the tree vs DualKV's depth-two packing
#   minshared  bench/min_shared.py: min_shared in 1..256, attention and the 1.7B model step
#   verl       bench/verl_update.py on the agentic batch (one task): DualKV's engine vs veRL's
#              own with FA-class varlen rows and fused log-probs; needs .whl-verl carried
#              (bench/verl_gpu_wheels.sh makes it); the DualKV engine packs prompt groups until
#              it packs trees (see bench/verl_update.py)
# Each step is bounded by `timeout` so that a call ends with the steps before it reported.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-.out/trees}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0
for step in "$@"; do
  case "$step" in
  build)
    echo "== build (D = 128, sm_90a) =="
    CMAKE_ARGS="-DDUALKV_CUDA=ON -DDUALKV_CUDA_HEAD_DIMS=128 -DDUALKV_CUDA_ARCHS=90a-real" \
      CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install --no-build-isolation --no-deps -q . \
      >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
    python3 -c "import torch, dualkv; print('dualkv', dualkv.__version__, 'torch', \
torch.__version__, torch.cuda.get_device_name())"
    ;;
  test)
    echo "== tree kernels: GPU tests at D = 128 =="
    (cd /tmp && timeout 150 python3 -m pytest "$OLDPWD/tests/python/test_tree.py" -q -x \
      -k "(gpu or cuda) and not 64 and not 256 and not 512" -p no:cacheprovider \
      >"$OUT/test_tree.log" 2>&1) || status=1
    tail -1 "$OUT/test_tree.log"; grep -E "^(FAILED|ERROR)" "$OUT/test_tree.log" | head
    ;;
  attention)
    echo "== attention: tree batches, then their depth-two twins =="
    timeout 270 python3 bench/attention.py --shapes tree \
      --methods dualkv,flex,fa4-rows,sdpa_cudnn --budget 170 --out "$OUT/trees" \
      >"$OUT/attention_trees.log" 2>&1 || status=1
    timeout 75 python3 bench/attention.py --shapes tree-d2 --methods dualkv \
      --out "$OUT/twins" >"$OUT/attention_twins.log" 2>&1 || status=1
    sed -n '/^GPU /,$p' "$OUT/attention_trees.log" "$OUT/attention_twins.log"
    grep -E "FAIL|error" "$OUT/attention_trees.log" | head
    python3 bench/attention.py --summary "$OUT/trees/attention.json" \
      "$OUT/twins/attention.json" | tee "$OUT/attention_summary.txt"
    ;;
  deep)
    echo "== attention: the long-horizon batch (deep trees) and its twin =="
    timeout 120 python3 bench/attention.py --shapes tree-deep --tree-segments listed \
      --methods dualkv --out "$OUT/deep" >"$OUT/attention_deep.log" 2>&1 || status=1
    sed -n '/^GPU /,$p' "$OUT/attention_deep.log"
    ;;
  model)
    echo "== model step: Qwen3-1.7B on the agentic tree batch =="
    timeout 200 python3 bench/model_step.py --presets 1.7b --shapes agentic \
      --paths standard,flex,dualkv,dualkv-depth2 --warmup 1 --repeats 2 \
      >"$OUT/model_step.log" 2>&1 || status=1
    grep -E "^\||^losses|^agentic|Error|error" "$OUT/model_step.log" | tail -12
    ;;
  minshared)
    echo "== min_shared sweep =="
    timeout 180 python3 bench/min_shared.py --warmup 1 --repeats 3 --out "$OUT" \
      >"$OUT/min_shared.log" 2>&1 || status=1
    sed -n '/^| min_shared/,$p' "$OUT/min_shared.log"
    grep -E "Error|error" "$OUT/min_shared.log" | head
    ;;
  verl)
    echo "== veRL engine update on the agentic batch =="
    if [ -f .whl-verl/ray-site.tar.xz ]; then
      mkdir -p /tmp/site && tar -C /tmp/site -xJf .whl-verl/ray-site.tar.xz &&
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
          --target /tmp/site .whl-verl/*.whl && export PYTHONPATH=/tmp/site
    fi
    timeout 330 python3 bench/verl_update.py --device cuda --shapes agentic --groups 1 \
      --steps 1 --capacity-max-groups 0 --baseline-attn dualkv_rows --baseline-logprobs fused \
      --json "$OUT/verl_update.jsonl" >"$OUT/verl_update.log" 2>&1 || status=1
    grep -E "^\||^#|Error|error" "$OUT/verl_update.log" | tail -20
    ;;
  *)
    echo "unknown step $step (build, test, attention, model, minshared, verl)"; exit 2
    ;;
  esac
done
exit $status
