#!/usr/bin/env bash
# A shorter GPU call than check.sh for optimizer work: builds the optimizer targets, runs their GPU
# tests and the optimizer benchmark (optionally filtered), and summarizes.
#   tools/gpu/run_optim.sh OUT_DIR [BENCHMARK_FILTER]
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_optim.sh OUT_DIR [BENCHMARK_FILTER]}
FILTER=${2:-.}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
gpu_build "$OUT" strata_optim_bench optim_adam_test optim_kernel_test || exit 1
status=0
GTEST_FILTER='*Gpu*' "$BUILD/bin/optim_adam_test" >"$OUT/tests.log" 2>&1 || status=1
GTEST_FILTER='*Gpu*' "$BUILD/bin/optim_kernel_test" >>"$OUT/tests.log" 2>&1 || status=1
grep -E "PASSED|FAILED" "$OUT/tests.log"
"$BUILD/bin/strata_optim_bench" --benchmark_filter="$FILTER" --benchmark_repetitions=3 \
  --benchmark_report_aggregates_only=true --benchmark_out="$OUT/optim_bench.json" \
  --benchmark_out_format=json >"$OUT/optim_bench.txt" 2>&1 || status=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$OUT/tests.log"
python3 tools/gpu/summarize_optim.py "$OUT/optim_bench.json" | tee "$OUT/summary.txt"
exit $status
