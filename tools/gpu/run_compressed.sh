#!/usr/bin/env bash
# Compressed moments on a GPU (issue 39; See Note [Compressed moments] in optim/state_codec.h).
#   perf: the CUDA kernel bitwise the host kernel (optim_compressed_states_test Gpu*) and
#     compute-sanitizer memcheck over it, the step's rates (strata_step_rates: the link's GB/s,
#     from which the floor of a streamed step follows), and strata-train's 24-block 1.34 B model
#     streamed under layer_prefetch with float32, bfloat16 and int8 moments in alternating rounds
#     (optimizer ms, bytes each way), then hybrid with int8 moments (the cost model's choice for
#     the smaller bytes, its prediction beside the measured step).
#   convergence: strata-train's 24-block GPT (d_model 512) trained on the Python standard
#     library's sources (--text_dir) for STEPS steps under layer_prefetch, once per state dtype;
#     the mean loss of the last 100 steps of each.
#   tools/gpu/run_compressed.sh OUT_DIR perf|convergence [ROUNDS|STEPS]
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_compressed.sh OUT_DIR perf|convergence [ROUNDS|STEPS]}
MODE=${2:?perf or convergence}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
status=0
gpu_info "$OUT"
echo "== build"
gpu_build "$OUT" strata_step_rates optim_compressed_states_test strata-train || exit 1
if [[ $MODE == perf ]]; then
  ROUNDS=${3:-2}
  echo "== optim_compressed_states_test (GPU), and memcheck over it"
  "$BUILD/bin/optim_compressed_states_test" --gtest_filter='Gpu*' >"$OUT/gpu-tests.log" 2>&1 ||
    status=1
  grep -E "^\[  (PASSED|FAILED) |FAILED \]" "$OUT/gpu-tests.log"
  /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 3 \
    "$BUILD/bin/optim_compressed_states_test" --gtest_filter='Gpu*' >"$OUT/memcheck.log" 2>&1 ||
    status=1
  grep -h "ERROR SUMMARY" "$OUT/memcheck.log"
  echo "== strata_step_rates"
  "$BUILD/bin/strata_step_rates" --json="$OUT/rates.json" || status=1
  model="--layers=24 --d_model=2048 --heads=16 --vocab=32000 --seq=512 --batch=8 --steps=5"
  model+=" --lr=1e-4 --dtype=bfloat16"
  for ((r = 0; r < ROUNDS; ++r)); do
    order="float32 int8 bfloat16"
    ((r % 2)) && order="bfloat16 int8 float32"
    for sd in $order; do
      echo "== strata-train, round $r, moments $sd" | tee -a "$OUT/train.log"
      "$BUILD/bin/strata-train" $model --strata_policy=layer_prefetch --state_dtype="$sd" \
        --json="$OUT/train-$sd-$r.json" >>"$OUT/train.log" 2>&1 || status=1
    done
  done
  echo "== strata-train, hybrid, moments int8" | tee -a "$OUT/train.log"
  "$BUILD/bin/strata-train" --compare $model --runs=hybrid,layer_prefetch --state_dtype=int8 \
    --json="$OUT/train-hybrid-int8.json" >>"$OUT/train.log" 2>&1 || status=1
  grep -aE "^== |\] hybrid: |^(layer_prefetch|hybrid) +ok" "$OUT/train.log"
else
  STEPS=${3:-1000}
  text=$(python3 -c "import os; print(os.path.dirname(os.__file__))")
  model="--layers=24 --d_model=512 --heads=8 --vocab=256 --seq=256 --batch=16 --lr=3e-4"
  for sd in float32 bfloat16 int8; do
    echo "== strata-train on $text, moments $sd" | tee -a "$OUT/convergence.log"
    "$BUILD/bin/strata-train" $model --steps="$STEPS" --text_dir="$text" \
      --strata_policy=layer_prefetch --state_dtype="$sd" --json="$OUT/convergence-$sd.json" \
      >>"$OUT/convergence.log" 2>&1 || status=1
  done
  python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
base = None
for sd in ("float32", "bfloat16", "int8"):
    try:
        run = json.load(open(f"{out}/convergence-{sd}.json"))["runs"][0]
    except (OSError, KeyError, IndexError, ValueError) as e:
        print(f"{sd}: no result ({e})")
        continue
    losses = [s["loss"] for s in run["steps"]]
    tail = sum(losses[-100:]) / len(losses[-100:])
    base = tail if sd == "float32" else base
    rel = "" if base is None or sd == "float32" else f"  ({100 * (tail / base - 1):+.2f}% vs float32)"
    print(f"{sd:<9} first loss {losses[0]:.4f}  mean of the last 100 steps {tail:.4f}{rel}")
PY
fi
rm -f "$OUT/configure.log" "$OUT/build.log"
exit $status
