#!/usr/bin/env bash
# Host steps in backward (Note [Host steps in backward] in optim/adam_host_speculation.cpp) on a
# GPU. `tests`: the C1 test (optim_overlap_gpu_test: hybrid, sequential and overlapped, bitwise
# layer_prefetch with the copy streams held up at random) and compute-sanitizer memcheck over its
# hybrid case. `time`: strata-train's 24-block GPT in bfloat16 with clipping at 1.0, the optimizer
# states streamed, in alternating rounds within one process: layer_prefetch sequential and
# overlapped, hybrid overlapped with the cost model's split; then hybrid overlapped with forced
# splits (FORCED="0.8 0.65 ...", the share of parameters stepped on the GPU) beside
# layer_prefetch+overlap. EXTRA flags go to every strata-train run (e.g. --dtype=float32).
#   tools/gpu/run_hybrid_overlap.sh OUT_DIR tests|time [EXTRA...]
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_hybrid_overlap.sh OUT_DIR tests|time [EXTRA...]}
MODE=${2:?usage: tools/gpu/run_hybrid_overlap.sh OUT_DIR tests|time [EXTRA...]}
shift 2
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
status=0
gpu_info "$OUT"
if [ "$MODE" = tests ]; then
  gpu_build "$OUT" optim_overlap_gpu_test optim_overlap_test || exit 1
  "$BUILD/bin/optim_overlap_gpu_test" >"$OUT/gpu-tests.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |OK \]|FAILED \]" "$OUT/gpu-tests.log" | head -20
  /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 3 \
    "$BUILD/bin/optim_overlap_gpu_test" --gtest_filter='*Hybrid*' >"$OUT/memcheck.log" 2>&1 ||
    status=1
  grep -h "ERROR SUMMARY" "$OUT/memcheck.log"
  rm -f "$OUT/configure.log" "$OUT/build.log"
  exit $status
fi
gpu_build "$OUT" strata-train || exit 1
model="--layers=24 --d_model=2048 --heads=16 --vocab=32000 --seq=512 --batch=8 --steps=6 --lr=1e-4"
model="$model --dtype=bfloat16 --clip_grad_norm=1.0 --strata_overlap=backward"
runs="layer_prefetch,layer_prefetch+overlap,hybrid+overlap,hybrid+overlap,layer_prefetch+overlap"
runs="$runs,layer_prefetch"
echo "== the cost model's split: $runs" | tee "$OUT/train.log"
"$BUILD/bin/strata-train" --compare $model --runs="$runs" "$@" --json="$OUT/train.json" \
  >>"$OUT/train.log" 2>&1 || status=1
for fraction in ${FORCED:-0.8 0.65}; do
  echo "== hybrid_fraction $fraction" | tee -a "$OUT/train.log"
  "$BUILD/bin/strata-train" --compare $model --strata_hybrid_fraction="$fraction" \
    --runs=hybrid+overlap,layer_prefetch+overlap,hybrid+overlap "$@" \
    --json="$OUT/train-$fraction.json" >>"$OUT/train.log" 2>&1 || status=1
done
grep -aE "^== |\] hybrid: |^(layer_prefetch|hybrid)[+a-z]* +ok|identical|outcomes|redone" \
  "$OUT/train.log"
rm -f "$OUT/configure.log" "$OUT/build.log"
exit $status
