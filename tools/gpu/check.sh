#!/usr/bin/env bash
# The one call strata makes on a GPU machine (H100/H200, CUDA 13, PyTorch 2.11, no network):
# unpack the Debian packages that tools/gpu/fetch-debs.sh fetched into .deps/debs, build with
# python3's LibTorch, run the gpu-labelled tests (the S1 soak among them), compute-sanitizer memcheck
# (--leak-check full), racecheck, synccheck and initcheck over them, the benchmarks, and
# write logs and JSON into OUT_DIR, ending with a short table.
#   tools/gpu/check.sh OUT_DIR [--quick] [--no-tests] [--no-cpu-tests] [--no-sanitizers] [--no-bench]
# --quick: 3 benchmark repetitions instead of 5. A call of the device tool lasts at most 600 s: the
# test, sanitizer and benchmark steps can be left out of one call and run in another
# (--no-cpu-tests skips only the suites that CI runs anyway).
# Files in OUT_DIR: summary.txt, allocator_bench.json, allocator_scaling.json and .svg,
# runtime_bench.json, optim_bench.json, compare.json (interleaved verdicts), logs.tar.gz.
set -uo pipefail
OUT=${1:?usage: tools/gpu/check.sh OUT_DIR [--quick] [--no-tests] [--no-cpu-tests] [--no-sanitizers] [--no-bench]}
shift
QUICK=; GPU_TESTS=1; CPU_TESTS=1; SANITIZERS=1; BENCH=1
for flag in "$@"; do
  case "$flag" in
    --quick) QUICK=--quick ;;
    --no-tests) GPU_TESTS=; CPU_TESTS= ;;
    --no-cpu-tests) CPU_TESTS= ;;
    --no-sanitizers) SANITIZERS= ;;
    --no-bench) BENCH= ;;
    *) echo "unknown flag $flag"; exit 2 ;;
  esac
done
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
LOGS=/tmp/strata-logs
mkdir -p "$OUT" "$LOGS"
cd "$ROOT"
source tools/gpu/build.sh
status=0
step() { echo "== $*"; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv \
  | tee "$LOGS/gpu.txt"
GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)

step "unpack .deps/debs, configure and build ($(nproc) cores)"
gpu_build "$LOGS" || exit $?
echo "built"

touch "$LOGS/ctest-gpu.log" "$LOGS/ctest-cpu.log"
if [ -n "$GPU_TESTS" ]; then
  step "ctest -L gpu"
  ctest --test-dir "$BUILD" -L gpu -V >"$LOGS/ctest-gpu.log" 2>&1 || status=1
  tail -8 "$LOGS/ctest-gpu.log"
  grep -hoE "L2: .*" "$LOGS/ctest-gpu.log" || true
fi
if [ -n "$CPU_TESTS" ]; then
  step "ctest (CPU suites, on this machine too)"
  ctest --test-dir "$BUILD" -LE gpu --output-on-failure >"$LOGS/ctest-cpu.log" 2>&1 || status=1
  tail -3 "$LOGS/ctest-cpu.log"
  step "the exhaustive fault sweep (make fault-sweep)"
  STRATA_FAULT_EXHAUSTIVE=1 "$BUILD/bin/reliability_fault_sweep_test" >"$LOGS/fault-sweep.log" 2>&1 \
    || status=1
  grep -E "^(fault sites|Adam step faults):" "$LOGS/fault-sweep.log"
fi

declare -A SAN
PROBE="not run"
if [ -n "$SANITIZERS" ]; then
step "compute-sanitizer memcheck --leak-check full"
# san_run name command...: compute-sanitizer's TOOL (default memcheck; memcheck checks leaks
# unless LEAK_CHECK=no) over one suite; the error count goes into the summary.
san_run() {
  local name=$1; shift
  local tool=${TOOL:-memcheck}
  local args=(--tool "$tool" --error-exitcode 99)
  [ "$tool" = memcheck ] && args+=(--leak-check "${LEAK_CHECK:-full}")
  compute-sanitizer "${args[@]}" "$@" >"$LOGS/$tool-$name.log" 2>&1
  local rc=$?
  local errors
  # memcheck, synccheck and initcheck end with "ERROR SUMMARY: N errors", racecheck with
  # "RACECHECK SUMMARY: H hazards displayed (N errors, W warnings)".
  errors=$(grep -oE "ERROR SUMMARY: [0-9]+|\([0-9]+ errors" "$LOGS/$tool-$name.log" | tail -1 |
    grep -oE "[0-9]+")
  SAN["$tool $name"]="${errors:-?} errors (exit $rc)"
  [ "$rc" = 0 ] || status=1
  echo "$tool $name: ${SAN["$tool $name"]}"
}
# The tests whose point is a failing CUDA call (out of memory on purpose) and the probe that writes
# out of bounds on purpose run in the plain ctest pass above, not here.
STRATA_L2_OPS=400 GTEST_FILTER='-*OutOfMemoryMessage*:*Probe*' \
  san_run allocator_gpu_test "$BUILD/bin/allocator_gpu_test"
# The same over cudaMalloc'd segments, whose blocks memcheck sees one by one.
STRATA_GPU_MEMORY=cudamalloc STRATA_L2_OPS=400 GTEST_FILTER='-*OutOfMemoryMessage*:*Probe*' \
  san_run allocator_gpu_test_cudamalloc "$BUILD/bin/allocator_gpu_test"
# Left out: the tests whose point is a refused or out-of-memory driver call (memcheck reports it).
GTEST_FILTER='*Gpu*:-*Impossible*:*Refused*:*MappingPast*' \
  san_run allocator_conformance "$BUILD/bin/allocator_conformance_test"
# The overlap test times copies, which the sanitizer distorts; it runs in the plain pass.
STRATA_D1_CYCLES=20 GTEST_FILTER='-*RunAtOnce*' san_run runtime_gpu_test "$BUILD/bin/runtime_gpu_test"
# LibTorch's caching allocator and cuBLAS keep their device memory until the process ends, so a
# leak check over the bridge reports LibTorch's segments, not strata's; strata's own leak checks run
# in the suites above.
GTEST_FILTER='*Gpu*:-*TwoToTheThirtyOne*' san_run optim_kernel "$BUILD/bin/optim_kernel_test"
if [ -x "$BUILD/bin/bridge_test" ]; then
  LEAK_CHECK=no GTEST_FILTER='*Gpu*' san_run bridge_gpu "$BUILD/bin/bridge_test"
fi
if [ -x "$BUILD/bin/bridge_phase_switch_test" ]; then
  LEAK_CHECK=no GTEST_FILTER='*Gpu*' san_run bridge_phase_switch "$BUILD/bin/bridge_phase_switch_test"
fi
LEAK_CHECK=no GTEST_FILTER='*Gpu*' san_run optim_adam "$BUILD/bin/optim_adam_test"
[ -x "$BUILD/bin/optim_overlap_gpu_test" ] &&
  san_run optim_overlap "$BUILD/bin/optim_overlap_gpu_test"
if [ -x "$BUILD/bin/bridge_scalars_test" ]; then
  LEAK_CHECK=no GTEST_FILTER='*Gpu*' san_run bridge_scalars "$BUILD/bin/bridge_scalars_test"
fi
GTEST_FILTER='*Gpu*' san_run optim_mixed "$BUILD/bin/optim_mixed_precision_test"
STRATA_SOAK_STEPS=200 GTEST_FILTER='*Gpu*' san_run soak "$BUILD/bin/reliability_soak_test"

step "compute-sanitizer racecheck, synccheck, initcheck (smaller runs: each is slower)"
for tool in racecheck synccheck initcheck; do
  TOOL=$tool GTEST_FILTER='*Gpu*:-*TwoToTheThirtyOne*' san_run optim_kernel \
    "$BUILD/bin/optim_kernel_test"
  TOOL=$tool STRATA_D1_CYCLES=5 GTEST_FILTER='-*RunAtOnce*' san_run runtime_gpu_test \
    "$BUILD/bin/runtime_gpu_test"
  # Under initcheck a copy queued behind a host function that waits for the test's own thread
  # never returns (the tool waits for the copy when it is queued), so the test that holds a copy
  # stream that way runs under the other tools only.
  skip='-*OutOfMemoryMessage*:*Probe*'
  [ "$tool" = initcheck ] && skip+=':*NotReusedEarly*'
  TOOL=$tool STRATA_L2_OPS=100 GTEST_FILTER="$skip" \
    san_run allocator_gpu_test "$BUILD/bin/allocator_gpu_test"
done
# The probe must be caught: proof that memcheck sees block bounds inside pool segments. Only
# cudaMalloc'd segments report their blocks to it (Note [Pool visibility for memory checkers]).
STRATA_GPU_MEMORY=cudamalloc GTEST_FILTER='*Probe*' compute-sanitizer --tool memcheck \
  "$BUILD/bin/allocator_gpu_test" >"$LOGS/memcheck-probe.log" 2>&1
# memcheck stops the faulting kernel, so the API calls after it report errors too; what counts is
# the report of the planted write with the block's exact bounds.
if grep -q "is 1 bytes after the nearest allocation at .* of size 1,000 bytes" "$LOGS/memcheck-probe.log"; then
  PROBE="caught: invalid write 1 byte after a 1000-byte pool block"
else
  PROBE="NOT caught"; status=1
fi
echo "memcheck probe (write past a block inside its segment): $PROBE"

fi  # SANITIZERS

if [ -n "$BENCH" ]; then
step "benchmarks"
REPS=5
[ "$QUICK" = "--quick" ] && REPS=3
# The optimizer's first: should a device call run out of time, issue 4's figures are in.
"$BUILD/bin/strata_optim_bench" --benchmark_repetitions=$REPS \
  --benchmark_report_aggregates_only=true --benchmark_out="$OUT/optim_bench.json" \
  --benchmark_out_format=json >"$LOGS/optim_bench.txt" 2>&1 || status=1
tail -5 "$LOGS/optim_bench.txt"
# The same approaches in alternating rounds, each step after its own reference sample, with
# verdicts only where every round agrees (bench/optim_compare.cpp; the scaling curves run in
# tools/gpu/run_compare.sh, which takes a device call of its own).
"$BUILD/bin/strata_optim_compare" --out="$OUT/compare.json" --rounds=$((REPS + 2)) \
  --parts=resident,streamed,bulk,mixed >"$LOGS/optim_compare.txt" 2>&1 || status=1
"$BUILD/bin/strata_allocator_bench" --benchmark_repetitions=$REPS \
  --benchmark_min_time=0.2 --benchmark_report_aggregates_only=true --benchmark_out="$OUT/allocator_bench.json" \
  --benchmark_out_format=json >"$LOGS/allocator_bench.txt" 2>&1 || status=1
tail -5 "$LOGS/allocator_bench.txt"
# Every repetition kept (no aggregates only): the plot takes median, min and max from them; the
# sizes run interleaved, so a drift of the machine spreads over all of them.
"$BUILD/bin/strata_allocator_scaling_bench" --benchmark_repetitions=$REPS \
  --benchmark_enable_random_interleaving=true --benchmark_min_time=0.2 \
  --benchmark_out="$OUT/allocator_scaling.json" \
  --benchmark_out_format=json >"$LOGS/allocator_scaling.txt" 2>&1 || status=1
python3 tools/plot_scaling.py "$OUT/allocator_scaling.json" "$OUT/allocator_scaling.svg" \
  --goal-ns=200 --title="strata pooled allocate+deallocate against live blocks" || status=1
# Every repetition kept, in random interleaving: the summary judges them one by one.
"$BUILD/bin/strata_runtime_bench" --benchmark_repetitions=$REPS \
  --benchmark_enable_random_interleaving=true --benchmark_display_aggregates_only=true \
  --benchmark_out="$OUT/runtime_bench.json" \
  --benchmark_out_format=json >"$LOGS/runtime_bench.txt" 2>&1 || status=1
tail -5 "$LOGS/runtime_bench.txt"

fi  # BENCH

step "summary"
{
  echo "GPU: $GPU_NAME"
  passed() { grep -E 'tests passed' "$1" | tail -1 | grep . || echo "not run"; }
  echo "tests: $(passed "$LOGS/ctest-gpu.log") (gpu); $(passed "$LOGS/ctest-cpu.log") (cpu)"
  for k in "${!SAN[@]}"; do echo "$k: ${SAN[$k]}"; done
  echo "memcheck probe: $PROBE"
  grep -hoE "(L2: |GPU D1: |2 GiB H2D |layer_prefetch depth |S1 soak ).*" "$LOGS/ctest-gpu.log" || true
  for bench in allocator:summarize_bench runtime:summarize_runtime optim:summarize_optim; do
    json="$OUT/${bench%%:*}_bench.json"
    [ -f "$json" ] && { python3 "tools/gpu/${bench#*:}.py" "$json" || true; }
  done
  [ -f "$OUT/compare.json" ] && { python3 tools/gpu/summarize_compare.py "$OUT/compare.json" || true; }
} | tee "$OUT/summary.txt"
tar -czf "$OUT/logs.tar.gz" -C "$LOGS" .
exit $status
