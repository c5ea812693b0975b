#!/usr/bin/env bash
# The optimizer step overlapped with backward (issue "Hide the optimizer"; Note [Overlapped step] in
# optim/adam.h) on strata-train's 24-block GPU config in bfloat16 with clipping at 1.0: the
# sequential layer_prefetch step, the overlapped one and PyTorch's resident fused AdamW, in
# alternation within one process (--runs, A B C A B C), with every role streamed in an 8 GiB budget
# (part all) and with only the optimizer states offloaded (part states); each strata run's last
# step's copies are traced (STRATA_TRACE_DIR) and plotted against backward's layers
# (tools/plot_trace.py). EXTRA flags go to every run (e.g. --batch=32). Logs, JSON, traces and
# SVGs go to OUT, named after PART and TAG (an environment variable naming the variant).
#   tools/gpu/run_overlap.sh OUT_DIR all|states [EXTRA...]
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_overlap.sh OUT_DIR all|states [EXTRA...]}
PART=${2:?usage: tools/gpu/run_overlap.sh OUT_DIR all|states [EXTRA...]}
shift 2
cd "$(dirname "$0")/../.."
TAG=$PART${TAG:+-$TAG}
mkdir -p "$OUT/trace-$TAG"
source tools/gpu/build.sh
gpu_build "$OUT" strata-train || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
MODEL="--layers=24 --d_model=2048 --heads=16 --vocab=32000 --seq=512 --batch=8 --lr=1e-4"
MODEL="$MODEL --dtype=bfloat16 --clip_grad_norm=1.0 --steps=5"
RUNS=layer_prefetch+overlap,torch_adamw_resident,layer_prefetch
RUNS=$RUNS,$RUNS
if [ "$PART" = all ]; then
  FLAGS="--strata_roles=all --strata_gpu_budget=8GiB"
else
  FLAGS="--strata_roles=optimizer_states"
fi
echo "== $TAG: $FLAGS $*"
STRATA_TRACE_DIR="$OUT/trace-$TAG" "$BUILD/bin/strata-train" --compare --strata_overlap=backward \
  $MODEL $FLAGS --runs=$RUNS "$@" --json="$OUT/$TAG.json" >"$OUT/$TAG.log" 2>&1
status=$?
grep -E "^\[.*\] step [0-9]+/|^== |wrote the copy trace" "$OUT/$TAG.log" | cut -c1-330
sed -n '/^summary/,$p' "$OUT/$TAG.log" | grep -vE "^(largest_free|  )" | head -14
for f in "$OUT/trace-$TAG"/*.csv; do
  [ -e "$f" ] || continue
  python3 tools/plot_trace.py "$f" "${f%.csv}.svg" --title "$(basename "${f%.csv}") ($TAG)"
done
exit $status
