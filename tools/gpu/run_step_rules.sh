#!/usr/bin/env bash
# The optimizer interface on a GPU (Note [Step rules] in optim/step_rule.h).
# `suite`: the gpu-labelled ctest suites and pytest -m gpu, then compute-sanitizer memcheck over
#   Lion's kernel test (its CUDA kernel bitwise the host kernel's).
# `c1`: the C1 test (optim_overlap_gpu_test: Adam's and Lion's hybrid runs bitwise layer_prefetch,
#   and Lion's overlapped step bitwise its sequential step, copy streams held up at random) and
#   memcheck over its Lion and hybrid cases.
# `time`: strata-train's 24-block GPT in bfloat16 with clipping at 1.0, the optimizer states
#   streamed, AdamW and Lion in alternating processes (the rule is a process's flag): layer_prefetch
#   sequential and overlapped, and for Lion hybrid overlapped with the cost model's split. EXTRA
#   flags go to every strata-train run.
#   tools/gpu/run_step_rules.sh OUT_DIR suite|c1|time [EXTRA...]
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_step_rules.sh OUT_DIR suite|c1|time [EXTRA...]}
MODE=${2:?usage: tools/gpu/run_step_rules.sh OUT_DIR suite|c1|time [EXTRA...]}
shift 2
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
status=0
gpu_info "$OUT"
memcheck() {
  local log=$1; shift
  /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 3 "$@" >"$OUT/$log" 2>&1 ||
    status=1
  echo "$log: $(grep -h "ERROR SUMMARY" "$OUT/$log")"
}
case "$MODE" in
  suite)
    gpu_build "$OUT" allocator_conformance_test allocator_gpu_test runtime_gpu_test \
      optim_kernel_test optim_adam_test optim_mixed_precision_test optim_compressed_states_test \
      optim_overlap_gpu_test reliability_soak_test bridge_test bridge_phase_switch_test \
      bridge_scalars_test bridge_torch_parity_test _strata || exit 1
    ctest --test-dir "$BUILD" -L gpu >"$OUT/ctest-gpu.log" 2>&1 || status=1
    tail -4 "$OUT/ctest-gpu.log"
    python_package || exit 1
    python3 -m pytest -q -m gpu python/tests >"$OUT/pytest-gpu.log" 2>&1 || status=1
    tail -2 "$OUT/pytest-gpu.log"
    memcheck memcheck-lion-kernel.log "$BUILD/bin/optim_kernel_test" --gtest_filter='GpuLion*'
    memcheck memcheck-fingerprint.log "$BUILD/bin/optim_kernel_test" \
      --gtest_filter='GpuFingerprint*'
    ;;
  c1)
    gpu_build "$OUT" optim_overlap_gpu_test || exit 1
    "$BUILD/bin/optim_overlap_gpu_test" >"$OUT/gpu-tests.log" 2>&1 || status=1
    grep -E "^\[  (PASSED|FAILED) |OK \]|FAILED \]" "$OUT/gpu-tests.log" | head -20
    memcheck memcheck-c1.log "$BUILD/bin/optim_overlap_gpu_test" --gtest_filter='*Lion*:*Hybrid*'
    ;;
  time)
    gpu_build "$OUT" strata-train || exit 1
    model="--layers=24 --d_model=2048 --heads=16 --vocab=32000 --seq=512 --batch=8 --steps=6"
    model="$model --lr=1e-4 --dtype=bfloat16 --clip_grad_norm=1.0 --strata_overlap=backward"
    for round in 1 2; do
      for opt in adamw lion; do
        runs="layer_prefetch,layer_prefetch+overlap"
        [ "$opt" = lion ] && runs="$runs,hybrid+overlap"
        echo "== round $round --optimizer=$opt: $runs" | tee -a "$OUT/train.log"
        "$BUILD/bin/strata-train" --compare $model --optimizer=$opt --runs="$runs" "$@" \
          --json="$OUT/train-$opt-$round.json" >>"$OUT/train.log" 2>&1 || status=1
      done
    done
    grep -aE "^== |\] hybrid: |^(layer_prefetch|hybrid)[+a-z]* +ok|identical" "$OUT/train.log"
    ;;
  *) echo "unknown mode $MODE"; exit 2 ;;
esac
rm -f "$OUT/configure.log" "$OUT/build.log"
exit $status
