#!/usr/bin/env bash
# strata under FSDP2 on every GPU of the machine (issues "Many GPUs" and "The FSDP2 run on two GPUs";
# NPROC=N to choose): examples/train_fsdp.py under torchrun with
# NCCL, the 24-block GPT of strata-train's GPU config in bf16 with MixedPrecisionPolicy, strata's
# optimizer states offloaded (layer_prefetch) against the resident FSDP2 + fused AdamW reference and
# FSDP2's CPUOffloadPolicy with torch's fused CPU AdamW; at the anchor's batch (8 x 512) and a
# larger one, where the forward and backward weigh more against the optimizer's traffic; and once
# with deterministic kernels, for the losses. With more than one rank, also a checkpoint saved by
# every rank after 4 steps, loaded by one rank and trained 4 more, beside one rank's 8-step run
# (compare steps 5-8). Then the 2-process CPU suite (gloo). NVLink multicast stays off
# (NCCL_NVLS_ENABLE=0). JSON and logs go to OUT/all.tgz, what it printed to OUT/summary.txt.
#   tools/gpu/run_fsdp.sh OUT_DIR [BATCHES]
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_fsdp.sh OUT_DIR [BATCHES]}
BATCHES=${2:-"8 32"}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
python_setup "$OUT" || exit 1
NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
export NCCL_NVLS_ENABLE=0
MODEL="--layers 24 --d_model 2048 --heads 16 --vocab 32000 --seq 512 --lr 1e-4"
status=0
run() {  # NAME FLAGS... (RANKS=n: another number of ranks than NPROC; NOREF=1: no reference)
  local name=$1
  shift
  local ref=--reference
  [ -n "${NOREF:-}" ] && ref=
  echo "== $name" | tee -a "$OUT/summary.txt"
  torchrun --standalone --nproc_per_node="${RANKS:-$NPROC}" examples/train_fsdp.py --device cuda \
    --dtype bfloat16 $MODEL --steps 8 --policy layer_prefetch $ref "$@" --json "$OUT/$name.json" \
    >"$OUT/$name.log" 2>&1 || status=1
  grep -vE "it/s|s/it" "$OUT/$name.log" | tail -6 | tee -a "$OUT/summary.txt"
}
# Losses against the reference with deterministic kernels (the fast attention's backward adds in
# a varying order, so two runs of anything differ), then the step times with the fast kernels.
run "fsdp_${NPROC}gpu_b8_deterministic" --batch 8 --deterministic
for b in $BATCHES; do
  run "fsdp_${NPROC}gpu_b$b" --batch "$b" --cpu_offload_peer
done
if ((NPROC > 1)); then
  rm -rf /tmp/fsdp-ckpt
  NOREF=1 run "ckpt_save_${NPROC}gpu" --batch 8 --deterministic --steps 4 --save /tmp/fsdp-ckpt
  NOREF=1 RANKS=1 run ckpt_load_1gpu --batch 8 --deterministic --steps 4 --load /tmp/fsdp-ckpt
  RANKS=1 run fsdp_1gpu_b8_deterministic --batch 8 --deterministic
fi
echo "== the 2-process suite (gloo, CPU)" | tee -a "$OUT/summary.txt"
python3 -m pytest -q python/tests/test_distributed.py >"$OUT/pytest_distributed.log" 2>&1 || status=1
tail -3 "$OUT/pytest_distributed.log" | tee -a "$OUT/summary.txt"
pack_out "$OUT"
exit $status
