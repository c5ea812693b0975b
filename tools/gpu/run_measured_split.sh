#!/usr/bin/env bash
# The hybrid's measured split on a GPU (Note [Measured split] in policies/split_search.h).
# `c1`: the C1 test (optim_overlap_gpu_test: hybrid bitwise layer_prefetch, the copy streams held
#   up at random; its unforced cases search and move layers) and memcheck over its hybrid cases.
# `time`: strata-train's 24-block GPT in bfloat16 with float32 masters, clipping at 1.0, the states
#   streamed, AdamW, STEPS steps a run (the search needs about 20), ROUNDS rounds, PAIRS of runs in
#   one process each, their order alternating: seq (layer_prefetch, hybrid with its measured split),
#   overlap (the same with +overlap), forced (hybrid and hybrid+overlap with a fifth of the
#   parameters on the host); summarize_split.py gives each run's median over its last 10 steps.
#   EXTRA flags go to every strata-train run.
#   tools/gpu/run_measured_split.sh OUT_DIR c1|time [EXTRA...]
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_measured_split.sh OUT_DIR c1|time [EXTRA...]}
MODE=${2:?usage: tools/gpu/run_measured_split.sh OUT_DIR c1|time [EXTRA...]}
shift 2
STEPS=${STEPS:-36}
ROUNDS=${ROUNDS:-2}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
status=0
gpu_info "$OUT"
case "$MODE" in
  c1)
    gpu_build "$OUT" optim_overlap_gpu_test policies_split_search_test || exit 1
    "$BUILD/bin/policies_split_search_test" >"$OUT/split-search-test.log" 2>&1 || status=1
    tail -1 "$OUT/split-search-test.log"
    "$BUILD/bin/optim_overlap_gpu_test" >"$OUT/gpu-tests.log" 2>&1 || status=1
    grep -E "^\[  (PASSED|FAILED) |OK \]|FAILED \]" "$OUT/gpu-tests.log" | head -20
    /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 3 \
      "$BUILD/bin/optim_overlap_gpu_test" --gtest_filter='*Hybrid*' >"$OUT/memcheck-c1.log" 2>&1 ||
      status=1
    echo "memcheck: $(grep -h "ERROR SUMMARY" "$OUT/memcheck-c1.log")"
    ;;
  time)
    gpu_build "$OUT" strata-train || exit 1
    model="--layers=24 --d_model=2048 --heads=16 --vocab=32000 --seq=512 --batch=8"
    model="$model --steps=$STEPS --lr=1e-4 --dtype=bfloat16 --clip_grad_norm=1.0"
    # Each pair in one process (the hybrid's search against layer_prefetch), the order alternating
    # between rounds.
    declare -A pairs=([seq]="layer_prefetch,hybrid" [overlap]="layer_prefetch+overlap,hybrid+overlap"
      [forced]="hybrid,hybrid+overlap")
    for round in $(seq 1 "$ROUNDS"); do
      for pair in ${PAIRS:-seq overlap forced}; do
        runs=${pairs[$pair]}
        ((round % 2 == 0)) && runs="${runs#*,},${runs%,*}"
        extra=()
        [ "$pair" = forced ] && extra=(--strata_hybrid_fraction=0.8)
        echo "== round $round $pair: $runs" | tee -a "$OUT/train.log"
        "$BUILD/bin/strata-train" --compare $model --runs="$runs" "${extra[@]}" "$@" \
          --json="$OUT/train-$pair-$round.json" >>"$OUT/train.log" 2>&1 || status=1
      done
    done
    grep -aE "^== |\] hybrid: |^(layer_prefetch|hybrid)[+a-z]* +ok|identical" "$OUT/train.log"
    python3 tools/gpu/summarize_split.py "$OUT"/train-*.json | tee "$OUT/summary.md"
    ;;
  *) echo "unknown mode $MODE"; exit 2 ;;
esac
rm -f "$OUT/configure.log" "$OUT/build.log"
exit $status
