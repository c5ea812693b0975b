#!/usr/bin/env bash
# strata-train's hybrid with host steps in backward, the working tree against a base that is the
# working tree with PATCH reversed (as run_patch_ab.sh makes it), both built: for each forced split
# (FORCED="0.8 0.55", the share of parameters stepped on the GPU) and round, base and new alternate,
# a process each, every process running hybrid+overlap, layer_prefetch+overlap, hybrid+overlap
# (--compare) on run_hybrid_overlap.sh's 24-block GPT in bfloat16 with clipping at 1.0. EXTRA
# flags go to every run. Lines a run: the runs' ms and outcomes; each run's JSON is kept.
#   tools/gpu/run_train_patch_ab.sh OUT PATCH ROUNDS [EXTRA...]
set -uo pipefail
OUT=$(realpath -m "${1:?}"); PATCH=$(realpath "${2:?}"); ROUNDS=${3:?}; shift 3
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
gpu_info "$OUT"
gpu_build "$OUT/new" strata-train || exit 1
new=$BUILD/bin/strata-train
base_tree "$PATCH" &&
  (cd /tmp/strata-base && BUILD=/tmp/strata-build-base && gpu_build "$OUT/base" strata-train) ||
  { echo "the base did not build"; exit 1; }
old=/tmp/strata-build-base/bin/strata-train
model="--layers=24 --d_model=2048 --heads=16 --vocab=32000 --seq=512 --batch=8 --steps=6 --lr=1e-4"
model="$model --dtype=bfloat16 --clip_grad_norm=1.0 --strata_overlap=backward"
for ((r = 0; r < ROUNDS; r++)); do
  for fraction in ${FORCED:-0.8 0.55}; do
    sides=(base new)
    ((r % 2)) && sides=(new base)
    for side in "${sides[@]}"; do
      bin=$new
      [ "$side" = base ] && bin=$old
      tag="r$r-$fraction-$side"
      # shellcheck disable=SC2086  # model is a list of flags
      "$bin" --compare $model --strata_hybrid_fraction="$fraction" \
        --runs=hybrid+overlap,layer_prefetch+overlap,hybrid+overlap "$@" \
        --json="$OUT/$tag.json" >"$OUT/$tag.log" 2>&1
      echo "== $tag (rc $?)" | tee -a "$OUT/summary.txt"
      grep -aE "^(layer_prefetch|hybrid)[+a-z]* +ok|identical|outcomes|redone" "$OUT/$tag.log" |
        tee -a "$OUT/summary.txt"
    done
  done
done
rm -rf "$OUT/new" "$OUT/base"
