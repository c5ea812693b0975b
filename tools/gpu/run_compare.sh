#!/usr/bin/env bash
# strata's optimizer step against its peers in interleaved rounds, and its scaling curves
# (bench/optim_compare.cpp), summarized with verdicts, fits and SVGs
# (tools/gpu/summarize_compare.py); with --probe also tools/gpu/probes/hbm_mix.cu (what a kernel
# with Adam's reads and writes reaches against a device-to-device copy). Everything goes to OUT.
#   tools/gpu/run_compare.sh OUT_DIR [PARTS] [ROUNDS] [--probe]
# PARTS: a comma-separated subset of resident,streamed,bulk,bytes,layers,tensors,first_step,mixed
# (all but mixed by default; a device call of 10 minutes fits about five of them after the build),
# and "runtime": bench/runtime_bench.cpp's migrations and offload_all + reload_all against raw
# pinned copies taken right before each cycle, 5 repetitions in random interleaving, judged
# repetition by repetition (tools/gpu/summarize_runtime.py). The caller names the commit in
# COMMIT: the device's copy of .git may be older than the tree.
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_compare.sh OUT_DIR [PARTS] [ROUNDS] [--probe]}
PARTS=${2:-resident,streamed,bulk,bytes,layers,tensors,first_step}
ROUNDS=${3:-7}
PROBE=${4:-}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
RUNTIME=
if [[ ",$PARTS," == *",runtime,"* ]]; then
  RUNTIME=1
  PARTS=$(echo ",$PARTS," | sed 's/,runtime,/,/; s/^,//; s/,$//')
fi
gpu_build "$OUT" strata_optim_compare ${RUNTIME:+strata_runtime_bench} || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
echo "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" | tee "$OUT/commit.txt"
status=0
if [ "$PROBE" = "--probe" ]; then
  /usr/local/cuda/bin/nvcc -O3 -arch=sm_90 tools/gpu/probes/hbm_mix.cu -o /tmp/hbm_mix &&
    /tmp/hbm_mix | tee "$OUT/hbm_mix.txt" || status=1
fi
if [ -n "$RUNTIME" ]; then
  "$BUILD/bin/strata_runtime_bench" --benchmark_repetitions=5 \
    --benchmark_enable_random_interleaving=true --benchmark_display_aggregates_only=true \
    --benchmark_out="$OUT/runtime_bench.json" --benchmark_out_format=json \
    >"$OUT/runtime_bench.log" 2>&1 || status=1
  python3 tools/gpu/summarize_runtime.py "$OUT/runtime_bench.json" |
    tee "$OUT/runtime_summary.txt" || status=1
fi
if [ -n "$PARTS" ]; then
  "$BUILD/bin/strata_optim_compare" --out="$OUT/compare.json" --rounds="$ROUNDS" \
    --parts="$PARTS" 2>&1 | tee "$OUT/compare.log" |
    grep -vE "^(first_step|tensors|layers|bytes) round"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  python3 tools/gpu/summarize_compare.py "$OUT/compare.json" --svg-dir="$OUT" |
    tee "$OUT/summary.txt" || status=1
fi
exit $status
