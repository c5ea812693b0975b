#!/usr/bin/env bash
# strata under FSDP2 on one GPU (issue "Many GPUs"): examples/train_fsdp.py under torchrun with
# NCCL, the 24-block GPT of strata-train's GPU config in bf16 with MixedPrecisionPolicy, strata's
# optimizer states offloaded (layer_prefetch) against the resident FSDP2 + fused AdamW reference and
# FSDP2's CPUOffloadPolicy with torch's fused CPU AdamW; at the anchor's batch (8 x 512) and a
# larger one, where the forward and backward weigh more against the optimizer's traffic; and once
# with deterministic kernels, for the losses. Then the 2-process CPU suite (gloo). JSON and logs
# go to OUT.
#   tools/gpu/run_fsdp.sh OUT_DIR [BATCHES]
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_fsdp.sh OUT_DIR [BATCHES]}
BATCHES=${2:-"8 32"}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
gpu_build "$OUT" _strata || exit 1
python_package || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
nproc | tee "$OUT/cpus.txt"
MODEL="--layers 24 --d_model 2048 --heads 16 --vocab 32000 --seq 512 --lr 1e-4"
status=0
run() {  # NAME FLAGS...
  local name=$1
  shift
  echo "== $name"
  torchrun --standalone --nproc_per_node=1 examples/train_fsdp.py --device cuda --dtype bfloat16 \
    $MODEL --steps 8 --policy layer_prefetch --reference "$@" --json "$OUT/$name.json" \
    >"$OUT/$name.log" 2>&1 || status=1
  grep -vE "it/s|s/it" "$OUT/$name.log" | tail -6
}
# Losses against the reference with deterministic kernels (the fast attention's backward adds in
# a varying order, so two runs of anything differ), then the step times with the fast kernels.
run fsdp_1gpu_b8_deterministic --batch 8 --deterministic
for b in $BATCHES; do
  run "fsdp_1gpu_b$b" --batch "$b" --cpu_offload_peer
done
echo "== the 2-process suite (gloo, CPU)"
python3 -m pytest -q python/tests/test_distributed.py >"$OUT/pytest_distributed.log" 2>&1 || status=1
tail -3 "$OUT/pytest_distributed.log"
exit $status
