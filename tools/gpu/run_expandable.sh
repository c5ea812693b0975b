#!/usr/bin/env bash
# Expandable segments on the GPU (Note [Expandable segments] in allocator/block_pool_expand.cpp):
# the allocator's GPU suites (the range calls of the CUDA virtual-memory upstream in the
# conformance suite, the expandable pool, the GPU tier); the allocator benchmark's replays, fixed
# and variable shapes, strata with expandable and fixed segments beside PyTorch's caching allocator
# by default and with expandable_segments:True (a second process: PyTorch reads the setting once),
# and pooled alloc+free on the GPU tier; then strata-train's phase switches (24 blocks, every role
# streamed in 8 GiB, a switch every 2 steps) with expandable and with fixed segments
# (STRATA_GPU_SEGMENTS=fixed), whose losses must match. Everything goes to OUT.
#   tools/gpu/run_expandable.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_expandable.sh OUT_DIR}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
gpu_build "$OUT" strata_allocator_bench allocator_conformance_test allocator_expandable_test \
  allocator_gpu_test allocator_pool_test runtime_gpu_test strata-train || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# The device's copy of the tree may carry an older .git: the caller names the commit.
echo "${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" | tee "$OUT/commit.txt"
status=0
for t in allocator_conformance_test allocator_expandable_test allocator_gpu_test \
  allocator_pool_test runtime_gpu_test; do
  "$BUILD/bin/$t" >"$OUT/$t.log" 2>&1 || { echo "$t FAILED"; status=1; }
  echo "$t: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$t.log" | tr '\n' ' ')"
done
B="$BUILD/bin/strata_allocator_bench"
"$B" --benchmark_filter='Replay' --benchmark_repetitions=3 \
  --benchmark_out="$OUT/replay.json" --benchmark_out_format=json >"$OUT/replay.txt" 2>&1 ||
  status=1
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$B" --benchmark_filter='ReplayTorch' \
  --benchmark_repetitions=3 --benchmark_out="$OUT/replay-torch-expandable.json" \
  --benchmark_out_format=json >"$OUT/replay-torch-expandable.txt" 2>&1 || status=1
"$B" --benchmark_filter='StrataAllocFree/gpu|TorchCachingAllocator' --benchmark_repetitions=5 \
  --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true \
  --benchmark_out="$OUT/allocfree.json" --benchmark_out_format=json >"$OUT/allocfree.txt" 2>&1 ||
  status=1
python3 - "$OUT" <<'PY'
import json, statistics, sys
d = sys.argv[1]
rows = {}
for f in ("replay.json", "replay-torch-expandable.json"):
    for b in json.load(open(f"{d}/{f}"))["benchmarks"]:
        if b.get("run_type") != "iteration" or "reserved_over_peak_allocated" not in b:
            continue
        name = b["run_name"] + (" (torch expandable_segments:True)" if "expandable" in f else "")
        rows.setdefault(name, []).append(b)
print("replay: reserved peak / peak allocated, steady step ms (median of 3), maps, map/unmap ms")
for name, bs in rows.items():
    b = bs[0]
    print(f"  {name:64s} {b['reserved_over_peak_allocated']:.4f}  "
          f"{statistics.median(x['steady_step_ms'] for x in bs):8.3f} ms  "
          f"maps {b.get('maps', '-')}  map {b.get('upstream_alloc_ms', '-')}  "
          f"unmap {b.get('upstream_free_ms', '-')}")
for b in json.load(open(f"{d}/allocfree.json"))["benchmarks"]:
    if b.get("aggregate_name") == "median":
        print(f"  {b['run_name']:64s} median {b['real_time']:.1f} {b['time_unit']}")
PY
MODEL="--layers=24 --d_model=2048 --heads=16 --vocab=32000 --seq=512 --batch=8 --lr=1e-4"
FLAGS="--strata_policy=layer_prefetch --strata_roles=all --strata_gpu_budget=8GiB --steps=6"
for seg in expandable fixed; do
  echo "== phase switches, $seg segments"
  STRATA_GPU_SEGMENTS=$seg "$BUILD/bin/strata-train" $MODEL $FLAGS --phase_switch_every=2 \
    --json="$OUT/switched-$seg.json" >"$OUT/switched-$seg.log" 2>&1 ||
    { echo "  FAILED (exit $?)"; status=1; }
  grep -E "phase switch after|^\[.*\] step [0-9]+/" "$OUT/switched-$seg.log" | cut -c1-400
done
python3 - "$OUT" <<'PY'
import json, sys
d = sys.argv[1]
l = {s: [x["loss"] for x in json.load(open(f"{d}/switched-{s}.json"))["runs"][0]["steps"]]
     for s in ("expandable", "fixed")}
print("losses, expandable == fixed segments:", l["expandable"] == l["fixed"], l["expandable"])
PY
exit $status
