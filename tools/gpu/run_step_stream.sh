#!/usr/bin/env bash
# What running each layer's overlapped step on a stream of its own gains (Note [The step stream] in
# bridge/model_hooks.cpp): strata-train's overlapped step (tools/gpu/run_overlap.sh, bfloat16,
# clipping at 1.0) with --strata_step_stream=own and =compute, one process each, alternating over
# ROUNDS rounds (default 2). A part is ROLES-bBATCH: ROLES all (every role streamed in an 8 GiB
# budget) or states (the optimizer states only), BATCH the sequences a step. Every run takes
# --prefetch_depth=${DEPTH:-3} and --strata_undo_on_gpu, and EXTRA flags. Files as run_overlap.sh's,
# tagged PART-own-rN / PART-compute-rN.
#   tools/gpu/run_step_stream.sh OUT_DIR PART... [-- EXTRA...]
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_step_stream.sh OUT_DIR PART... [-- EXTRA...]}
shift
PARTS=()
while (($#)) && [ "$1" != -- ]; do PARTS+=("$1"); shift; done
(($#)) && shift
((${#PARTS[@]})) || { echo "no PART given (e.g. states-b8 all-b32)"; exit 2; }
cd "$(dirname "$0")/../.."
status=0
for part in "${PARTS[@]}"; do
  roles=${part%-b*}
  batch=${part##*-b}
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for where in own compute; do
      TAG=b$batch-$where-r$round tools/gpu/run_overlap.sh "$OUT" "$roles" --batch="$batch" \
        --prefetch_depth="${DEPTH:-3}" --strata_undo_on_gpu --strata_step_stream=$where "$@" \
        || status=1
    done
  done
done
exit $status
