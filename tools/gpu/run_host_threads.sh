#!/usr/bin/env bash
# How many threads should the host kernel of a hybrid step run on? tools/gpu/probes/link_host_adam
# measures the link both ways and host Adam at once for each thread count (the split each pair
# could reach, by the cost model's link and host terms); then strata-train's 24-block GPT
# (1.34 G parameters, bfloat16 with float32 masters, clipping at 1.0, the states streamed) runs
# layer_prefetch against hybrid with a forced split for each "FRACTION:THREADS" in SPLITS (the
# share stepped on the GPU, or auto for the cost model's choice and the measured search; and
# --strata_host_threads), a pair a process, the order alternating between rounds;
# summarize_split.py gives each run's medians over its last 10 steps. The hybrid's placement line
# gives the cost model's prediction beside each. Without SPLITS only the probe runs. TRACE=1 traces
# each run's last step (STRATA_TRACE_DIR) and prints, per stream, the optimizer step's copies
# (tools/plot_trace.py); each step's line gives the host's queued/waited/kernel ms.
#   [PROBE=0] [PROBE_MODEL=bfloat16] [SPLITS="auto:16 0.65:8"] [STEPS=14] [AUTO_STEPS=56] [ROUNDS=1] \
#     [DTYPE=float32] [TRACE=1] [EXTRA="--strata_overlap=backward"] tools/gpu/run_host_threads.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_host_threads.sh OUT_DIR}
STEPS=${STEPS:-14}
ROUNDS=${ROUNDS:-1}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
status=0
gpu_info "$OUT"
if [[ ${PROBE:-1} != 0 ]]; then
  echo "== link_host_adam"
  /usr/local/cuda/bin/nvcc -O3 -Xcompiler -O3,-march=native,-fno-math-errno,-pthread \
    tools/gpu/probes/link_host_adam.cu -o /tmp/link_host_adam || exit 1
  /tmp/link_host_adam "$(nproc)" ${PROBE_MODEL:-} | tee "$OUT/link-host-adam.txt" || status=1
fi
[[ -z ${SPLITS:-} ]] && exit $status
gpu_build "$OUT" strata-train strata_step_rates || exit 1
echo "== strata_step_rates"
"$BUILD/bin/strata_step_rates" --json="$OUT/rates.json" | tee "$OUT/rates.txt" || status=1
model="--layers=24 --d_model=2048 --heads=16 --vocab=32000 --seq=512 --batch=8"
model="$model --steps=$STEPS --lr=1e-4 --dtype=${DTYPE:-bfloat16} --clip_grad_norm=1.0"
for round in $(seq 1 "$ROUNDS"); do
  for split in $SPLITS; do
    [[ $split == *:* ]] || { echo "SPLITS entries are FRACTION:THREADS, not '$split'"; exit 2; }
    fraction=${split%%:*} threads=${split##*:}
    runs="layer_prefetch,hybrid"
    ((round % 2 == 0)) && runs="hybrid,layer_prefetch"
    forced=(--strata_hybrid_fraction="$fraction")
    [[ $fraction == auto ]] && forced=(--steps="${AUTO_STEPS:-56}")  # the search: 28-32 steps, up to 52
    echo "== round $round: $runs, hybrid_fraction $fraction, host threads $threads" |
      tee -a "$OUT/train.log"
    tag="$fraction-$threads-$round"
    trace=()
    [[ ${TRACE:-0} != 0 ]] && mkdir -p "$OUT/trace-$tag" && trace=(env STRATA_TRACE_DIR="$OUT/trace-$tag")
    "${trace[@]}" "$BUILD/bin/strata-train" --compare $model --runs="$runs" "${forced[@]}" \
      --strata_host_threads="$threads" ${EXTRA:-} --json="$OUT/train-$tag.json" \
      >>"$OUT/train.log" 2>&1 || status=1
    for csv in "$OUT/trace-$tag"/*.csv; do
      [[ -f $csv ]] || continue
      echo "== trace $csv" | tee -a "$OUT/traces.txt"
      python3 tools/plot_trace.py "$csv" "${csv%.csv}.svg" | tee -a "$OUT/traces.txt"
    done
  done
done
grep -aE "^== |\] hybrid: |^(layer_prefetch|hybrid)[+a-z]* +ok|identical" "$OUT/train.log"
python3 tools/gpu/summarize_split.py "$OUT"/train-*.json | tee "$OUT/summary.md"
rm -f "$OUT/configure.log" "$OUT/build.log"
exit $status
