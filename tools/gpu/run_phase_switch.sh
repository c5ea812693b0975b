#!/usr/bin/env bash
# Phase switches of strata-train's 24-block GPU config (the model of run_train.sh: 1.3 B
# parameters, every role streamed in an 8 GiB budget) on the GPU: layer_prefetch with a switch
# every 2 steps and the same run without switches (the losses must be bitwise equal); keep_on_gpu
# with no budget and the whole training state (21 GB) on the GPU; then --compare with switches,
# each policy's switch cost beside PyTorch's (.to() with non_blocking copies). Each switch reports
# its time against the link floor of its bytes (raw pinned copies right before it) and the GPU
# memory the driver saw freed (cudaMemGetInfo). Logs and JSON go to OUT. First, the probe of
# tools/gpu/probes/free_overlap.cu: whether each way of freeing GPU memory waits for copies.
#   tools/gpu/run_phase_switch.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_phase_switch.sh OUT_DIR}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
gpu_build "$OUT" strata-train || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
/usr/local/cuda/bin/nvcc -O2 -arch=sm_90 tools/gpu/probes/free_overlap.cu -lcuda \
  -o "$BUILD/free_overlap" && "$BUILD/free_overlap" | tee "$OUT/free_overlap.txt"
MODEL="--layers=24 --d_model=2048 --heads=16 --vocab=32000 --seq=512 --batch=8 --lr=1e-4"
status=0
run() {  # name flags...
  local name=$1; shift
  echo "== $name: $*"
  "$BUILD/bin/strata-train" $MODEL "$@" --json="$OUT/$name.json" >"$OUT/$name.log" 2>&1 ||
    { echo "  FAILED (exit $?)"; status=1; }
  grep -E "phase switch after|^\[.*\] step [0-9]+/" "$OUT/$name.log" | cut -c1-400
}
run layer_prefetch-switched --strata_policy=layer_prefetch --strata_roles=all \
  --strata_gpu_budget=8GiB --steps=6 --phase_switch_every=2
run layer_prefetch-plain --strata_policy=layer_prefetch --strata_roles=all \
  --strata_gpu_budget=8GiB --steps=6
# The same switches with cudaMalloc'd segments, whose cudaFree waits for every copy in flight
# (Note [Device memory method] in allocator/cuda_device_upstream.cpp): the frees cannot hide.
run layer_prefetch-switched-cudamalloc --strata_policy=layer_prefetch --strata_roles=all \
  --strata_gpu_budget=8GiB --steps=6 --phase_switch_every=2 --strata_gpu_memory=cudamalloc
python3 - "$OUT" <<'PY'
import json, sys
d = sys.argv[1]
a = json.load(open(f"{d}/layer_prefetch-switched.json"))["runs"][0]
b = json.load(open(f"{d}/layer_prefetch-plain.json"))["runs"][0]
la, lb = [s["loss"] for s in a["steps"]], [s["loss"] for s in b["steps"]]
print("layer_prefetch losses with switches == without:", la == lb, la)
PY
run keep_on_gpu-switched --strata_policy=keep_on_gpu --steps=4 --phase_switch_every=2
run compare-switched --compare --strata_roles=all --strata_gpu_budget=8GiB --steps=4 \
  --phase_switch_every=2
sed -n '/^summary/,$p' "$OUT/compare-switched.log"
exit $status
