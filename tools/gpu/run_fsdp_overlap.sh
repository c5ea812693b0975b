#!/usr/bin/env bash
# strata under FSDP2 on one GPU with each fully_shard unit stepped during its backward (issue "Many
# GPUs"): examples/train_fsdp.py under torchrun --nproc_per_node=1 with NCCL on the 24-block GPT of
# strata-train's GPU config, bf16 with MixedPrecisionPolicy, clipping at 1.0, the Adam moments
# offloaded by layer_prefetch. Parts, each one torchrun (JSON and log in OUT):
#   b32       --overlap backward --undo_on_gpu, with the resident reference and CPUOffloadPolicy
#   b32-host  --overlap backward, the redo's copy of the fp32 shards in pinned memory
#   b32-seq   the step after backward, clipping in the optimizer (what the overlap must equal)
#   b8        as b32 at the anchor's batch
#   b8-det    deterministic kernels, overlap against the reference's losses
#   b32-k<N>  as b32 with --prefetch_depth N (the ring's depth), without the peer
#   tools/gpu/run_fsdp_overlap.sh OUT_DIR [PART...]   (default: b32 b32-host b32-seq b8 b8-det)
# DEPTH=N: --prefetch_depth for every part (default 3: with fewer slots the fetch into a slot waits
# for the write-back out of it, and the two directions of the link take turns).
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_fsdp_overlap.sh OUT_DIR [PART...]}
shift
PARTS=("$@")
((${#PARTS[@]})) || PARTS=(b32 b32-host b32-seq b8 b8-det)
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
python_setup "$OUT" || exit 1
export NCCL_NVLS_ENABLE=0
MODEL="--layers 24 --d_model 2048 --heads 16 --vocab 32000 --seq 512 --lr 1e-4"
OVERLAP="--overlap backward --undo_on_gpu"
status=0
run() {  # NAME FLAGS...
  local name=$1
  shift
  echo "== $name"
  torchrun --standalone --nproc_per_node=1 examples/train_fsdp.py --device cuda --dtype bfloat16 \
    $MODEL --steps 8 --policy layer_prefetch --max_grad_norm 1.0 --prefetch_depth "${DEPTH:-3}" \
    "$@" --json "$OUT/$name.json" \
    >"$OUT/$name.log" 2>&1 || status=1
  grep -vE "it/s|s/it" "$OUT/$name.log" | tail -5
}
for part in "${PARTS[@]}"; do
  case $part in
    b32) run fsdp_b32_overlap --batch 32 $OVERLAP --reference --cpu_offload_peer ;;
    b32-host) run fsdp_b32_overlap_host_undo --batch 32 --overlap backward ;;
    b32-seq) run fsdp_b32_sequential --batch 32 --overlap none --clip_in_optimizer ;;
    b8) run fsdp_b8_overlap --batch 8 $OVERLAP --reference --cpu_offload_peer ;;
    b32-k*) run "fsdp_b32_overlap_$part" --batch 32 $OVERLAP --reference \
      --prefetch_depth "${part#b32-k}" ;;
    b8-det) run fsdp_b8_overlap_deterministic --batch 8 $OVERLAP --reference --deterministic ;;
    *) echo "unknown part '$part'"; status=2 ;;
  esac
done
exit $status
