#!/usr/bin/env bash
# strata-train on the GPU: a short run under each policy; a short --compare with every role
# streamed and no budget (layer_prefetch streaming parameters and gradients must give keep_on_gpu's
# losses bitwise); then the --compare run of issue 5 on a model whose Adam states are larger than
# the strata GPU budget (keep_on_gpu must run out of memory, bulk and layer_prefetch train with
# identical losses). Logs, JSON and chart go to OUT.
#   tools/gpu/run_train.sh OUT_DIR [extra strata-train flags for the compare run]
#
# The compare model: 24 blocks of d_model 2048 (1.3 B parameters, 5.3 GB; Adam states 10.6 GB),
# budget 8 GiB (8.6 GB). Parameters and gradients are as large as the states, so they stream too
# (--strata_roles=all): layer_prefetch through a ring of two layers, bulk a layer at a time.
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_train.sh OUT_DIR [flags]}
shift
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
gpu_build "$OUT" strata-train apps_test || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
for policy in keep_on_gpu bulk layer_prefetch; do
  echo "== short run, $policy" | tee -a "$OUT/short.log"
  "$BUILD/bin/strata-train" --strata_policy=$policy --steps=3 >>"$OUT/short.log" 2>&1 ||
    { echo "  FAILED"; status=1; }
done
grep -E "^\[.*\] step 3/3|no live allocations|FAILED" "$OUT/short.log"
echo "== short compare, every role streamed, no budget" | tee -a "$OUT/short.log"
"$BUILD/bin/strata-train" --compare --strata_roles=all --layers=8 --steps=3 \
  --json="$OUT/short-compare-all.json" >>"$OUT/short.log" 2>&1 || status=1
grep -E "^losses identical|^largest loss" "$OUT/short.log"
"$BUILD/bin/strata-train" --compare --layers=24 --d_model=2048 --heads=16 --vocab=32000 \
  --seq=512 --batch=8 --steps=8 --lr=1e-4 --strata_roles=all --strata_gpu_budget=8GiB \
  --json="$OUT/compare.json" --chart="$OUT/compare.svg" "$@" >"$OUT/compare.log" 2>&1 || status=1
sed -n '/^summary/,$p' "$OUT/compare.log"
grep -E "FAILED" "$OUT/compare.log" | head -5
exit $status
