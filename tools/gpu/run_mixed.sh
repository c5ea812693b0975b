#!/usr/bin/env bash
# Mixed precision on the GPU (issue "Train the way LLMs are trained"): the mixed-precision suite;
# bench/mixed_bench.cpp (the bfloat16 step with float32 masters, streamed and resident, against
# PyTorch's best peers; --bench-only runs just it); strata-train --compare in
# bfloat16 on the 24-block config of run_train.sh (every role streamed in an 8 GiB budget, clipping
# at 1.0), whose PyTorch baselines keep float32 master weights; and a short float16 --compare with
# dynamic loss scaling; and the parity test against torch._fused_adamw_ (bitwise masters without
# clipping). Logs and JSON go to OUT.
#   tools/gpu/run_mixed.sh OUT_DIR [--bench-only]
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_mixed.sh OUT_DIR [--bench-only]}
BENCH_ONLY=${2:-}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
gpu_build "$OUT" strata-train optim_mixed_precision_test strata_mixed_bench \
  bridge_torch_parity_test || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
status=0
echo "== bench/mixed_bench.cpp"
"$BUILD/bin/strata_mixed_bench" --benchmark_out="$OUT/mixed_bench.json" \
  --benchmark_out_format=json >"$OUT/mixed_bench.log" 2>&1 || status=1
grep -E "^BM_" "$OUT/mixed_bench.log" | cut -c1-300
[ "$BENCH_ONLY" = "--bench-only" ] && exit $status
echo "== the mixed-precision suite"
"$BUILD/bin/optim_mixed_precision_test" >"$OUT/mixed-test.log" 2>&1 || status=1
grep -E "^\[ +(OK|FAILED|SKIPPED) " "$OUT/mixed-test.log"
echo "== parity with torch._fused_adamw_"
GTEST_FILTER='*Gpu*' "$BUILD/bin/bridge_torch_parity_test" >"$OUT/parity-test.log" 2>&1 || status=1
grep -E "^\[ +(OK|FAILED|SKIPPED) |Failure|worst" "$OUT/parity-test.log" | head -20
echo "== float16 --compare, 8 blocks"
"$BUILD/bin/strata-train" --compare --dtype=float16 --strata_roles=all --layers=8 --steps=6 \
  --json="$OUT/compare-f16.json" >"$OUT/compare-f16.log" 2>&1 || status=1
sed -n '/^summary/,$p' "$OUT/compare-f16.log" | grep -vE "^(largest_free|  )" | head -12
echo "== bfloat16 --compare, 24 blocks, every role streamed, 8 GiB"
"$BUILD/bin/strata-train" --compare --dtype=bfloat16 --layers=24 --d_model=2048 --heads=16 \
  --vocab=32000 --seq=512 --batch=8 --steps=5 --lr=1e-4 --strata_roles=all \
  --strata_gpu_budget=8GiB --json="$OUT/compare-bf16.json" >"$OUT/compare-bf16.log" 2>&1 ||
  status=1
sed -n '/^summary/,$p' "$OUT/compare-bf16.log" | grep -vE "^(largest_free|  )" | head -12
grep -E "FAILED" "$OUT/compare-bf16.log" | cut -c1-300 | head -5
exit $status
