#!/usr/bin/env bash
# The hybrid policy on a GPU (issue 38): the step's rates measured on this machine with the cost
# model's predictions (strata_step_rates), the C1 test of hybrid against layer_prefetch in every
# dtype with clipping (optim_overlap_gpu_test), compute-sanitizer memcheck over it, and the
# optimizer step of strata-train's 24-block model under layer_prefetch, hybrid and torch's fused
# AdamW on the host with its copies (torch_adamw_host: See Note [The host step's baseline] in
# apps/train/torch_run.cpp) in alternating rounds, float32 and bfloat16, then hybrid with forced
# splits (FORCED="dtype:fraction ...") (the hybrid's placement line gives the cost model's
# prediction beside each measured step); host memory's bandwidth by access pattern
# (tools/gpu/probes/host_memory.py). TESTS=0 leaves out the GPU tests and memcheck.
#   [TESTS=0] [FORCED="bfloat16:0.6 ..."] tools/gpu/run_hybrid.sh OUT_DIR [ROUNDS]
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_hybrid.sh OUT_DIR [ROUNDS]}
ROUNDS=${2:-2}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
status=0
gpu_info "$OUT"
echo "== build"
gpu_build "$OUT" strata_step_rates optim_overlap_gpu_test optim_kernel_test strata-train || exit 1
echo "== strata_step_rates"
"$BUILD/bin/strata_step_rates" --json="$OUT/rates.json" || status=1
echo "== host memory by access pattern"
python3 tools/gpu/probes/host_memory.py 1 "$(nproc)" | tee "$OUT/host-memory.json"
if [[ ${TESTS:-1} != 0 ]]; then
  echo "== optim_overlap_gpu_test, optim_kernel_test (GPU)"
  { "$BUILD/bin/optim_overlap_gpu_test" && "$BUILD/bin/optim_kernel_test" --gtest_filter='Gpu*'; } \
    >"$OUT/gpu-tests.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |OK \] .*Hybrid|FAILED \]" "$OUT/gpu-tests.log" | head -20
  echo "== compute-sanitizer memcheck: the hybrid C1 test"
  /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 3 \
    "$BUILD/bin/optim_overlap_gpu_test" --gtest_filter='*Hybrid*' >"$OUT/memcheck.log" 2>&1 ||
    status=1
  grep -h "ERROR SUMMARY" "$OUT/memcheck.log"
fi
runs=""
for ((r = 0; r < ROUNDS; ++r)); do
  if ((r % 2 == 0)); then
    runs+="layer_prefetch,hybrid,torch_adamw_host,"
  else
    runs+="torch_adamw_host,hybrid,layer_prefetch,"
  fi
done
model="--layers=24 --d_model=2048 --heads=16 --vocab=32000 --seq=512 --batch=8 --steps=5 --lr=1e-4"
for dtype in float32 bfloat16; do
  echo "== strata-train, $dtype: ${runs%,}" | tee -a "$OUT/train.log"
  "$BUILD/bin/strata-train" --compare $model --dtype="$dtype" --runs="${runs%,}" \
    --json="$OUT/train-$dtype.json" >>"$OUT/train.log" 2>&1 || status=1
done
# Forced splits beside the cost model's choice: the prediction against the measured step.
for forced in ${FORCED:-float32:0.8 bfloat16:0.8 bfloat16:0.6}; do
  dtype=${forced%%:*} fraction=${forced##*:}
  echo "== strata-train, $dtype, hybrid_fraction $fraction" | tee -a "$OUT/train.log"
  "$BUILD/bin/strata-train" --compare $model --dtype="$dtype" --runs=hybrid,hybrid \
    --strata_hybrid_fraction="$fraction" >>"$OUT/train.log" 2>&1 || status=1
done
grep -aE "^== |\] hybrid: |^(layer_prefetch|hybrid|torch_adamw_host) +ok|identical" "$OUT/train.log"
rm -f "$OUT/configure.log" "$OUT/build.log"
exit $status
