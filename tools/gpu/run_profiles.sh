#!/usr/bin/env bash
# torch.profiler over 3 steps of bench/users_script.py approaches, each a process of its own, and
# bench/trace_copies.py over each trace: the compute stream's gaps, the copies and the host's work
# in each, and the host's CUDA calls.
# The word `stack` among them profiles the approaches after it with Python's stack too (the trace
# then names the Python function that queued each wait; it slows the host).
#   tools/gpu/run_profiles.sh OUT BATCH APPROACH ... [stack APPROACH ...]
# e.g. tools/gpu/run_profiles.sh OUT 32 strata fsdp2_strata stack strata
set -uo pipefail
OUT=${1:?}; BATCH=${2:?}; shift 2
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
python_setup "$OUT" || exit 1
stack=()
for approach in "$@"; do
  if [[ $approach == stack ]]; then
    stack=(--profile_stack)
    continue
  fi
  timeout 300 python3 bench/users_script.py --one "$approach" --batch "$BATCH" --warmup 20 \
    --steps 8 --profile "$OUT" "${stack[@]}" >"$OUT/one-$approach${stack:+-stack}.txt" 2>&1
  for trace in "$OUT"/profile-"${approach%@*}"-*b"$BATCH"*.json.gz; do
    [[ -e $trace ]] || continue
    python3 bench/trace_copies.py "$trace" --gaps 4 >"${trace%.json.gz}-copies.txt" 2>&1
    rm -f "$trace"
  done
done
rm -f "$OUT/configure.log" "$OUT/build.log"
pack_out "$OUT"
