#!/usr/bin/env bash
# Users' loops on a GPU (the issue "a user's own training loop trains correctly"): the optim and
# bridge GPU tests (the kernel's per-parameter step counts and skipped-step counts among them), the
# users' loops under pytest with their gpu marks (the float16 GradScaler loop bitwise
# torch.optim.AdamW(fused=True)'s, with and without overlap, with a skipped step), the Hugging
# Face Trainer-shaped example over 50 steps, and compute-sanitizer memcheck over the kernel tests.
#   tools/gpu/run_users_loops.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_users_loops.sh OUT_DIR}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
echo "== build"
gpu_build "$OUT" _strata optim_kernel_test optim_adam_test optim_mixed_precision_test \
  optim_overlap_test optim_overlap_gpu_test bridge_test bridge_torch_parity_test \
  bridge_scalars_test bridge_phase_switch_test || exit 1
python_package || exit 1
echo "== ctest -L gpu -R optim|bridge"
ctest --test-dir "$BUILD" -L gpu -R "optim|bridge" --output-on-failure >"$OUT/ctest-gpu.log" 2>&1 ||
  status=1
tail -12 "$OUT/ctest-gpu.log"
echo "== pytest: users' loops and the GPU suite"
python3 -m pytest -q -rfs python/tests/test_users_loops.py python/tests/test_gpu.py \
  >"$OUT/pytest.log" 2>&1 || status=1
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
tail -1 "$OUT/pytest.log"
echo "== examples/hf_trainer_loop.py on CUDA"
for overlap in none backward; do
  for clip in 1.0 0; do
    echo "-- overlap=$overlap max_grad_norm=$clip" >>"$OUT/hf_example.log"
    python3 examples/hf_trainer_loop.py --device cuda --steps 50 --compare --overlap "$overlap" \
      --prefetch_depth 2 --max_grad_norm "$clip" >>"$OUT/hf_example.log" 2>&1 || status=1
    echo "overlap=$overlap max_grad_norm=$clip: $(tail -2 "$OUT/hf_example.log" | tr '\n' ' ')"
  done
done
echo "== compute-sanitizer memcheck: the kernel tests"
/usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 3 \
  "$BUILD/bin/optim_kernel_test" --gtest_filter='Gpu*' >"$OUT/memcheck.log" 2>&1 || status=1
/usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 3 \
  "$BUILD/bin/optim_mixed_precision_test" --gtest_filter='Gpu*' >>"$OUT/memcheck.log" 2>&1 ||
  status=1
grep -h "ERROR SUMMARY" "$OUT/memcheck.log"
rm -f "$OUT/configure.log"  # the build log stays: 8 files come back
exit $status
