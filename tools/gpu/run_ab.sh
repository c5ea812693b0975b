#!/usr/bin/env bash
# Two variants of strata-train's overlapped step, one process each, alternating over ROUNDS rounds
# (default 2) so that drift on the machine hits both alike: each process is tools/gpu/run_overlap.sh
# (the overlapped step, PyTorch's resident fused AdamW and the sequential step, interleaved), with
# the variant's flags. A variant is NAME=FLAGS (FLAGS space-separated). A part is ROLES-bBATCH:
# ROLES all (every role streamed in an 8 GiB budget) or states (the optimizer states only), BATCH
# the sequences a step. Every run takes --prefetch_depth=${DEPTH:-3}, --strata_undo_on_gpu and
# EXTRA flags. Files as run_overlap.sh's, tagged PART-bBATCH-NAME-rN.
#   tools/gpu/run_ab.sh OUT_DIR NAME_A=FLAGS NAME_B=FLAGS PART... [-- EXTRA...]
#   e.g. tools/gpu/run_ab.sh out end-stream=--step_end=stream end-device=--step_end=device states-b8
set -uo pipefail
usage="usage: tools/gpu/run_ab.sh OUT_DIR NAME_A=FLAGS NAME_B=FLAGS PART... [-- EXTRA...]"
OUT=${1:?$usage}
A=${2:?$usage}
B=${3:?$usage}
shift 3
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
    for variant in "$A" "$B"; do
      name=${variant%%=*}
      # shellcheck disable=SC2086  # FLAGS is a list of flags
      TAG=b$batch-$name-r$round tools/gpu/run_overlap.sh "$OUT" "$roles" --batch="$batch" \
        --prefetch_depth="${DEPTH:-3}" --strata_undo_on_gpu ${variant#*=} "$@" || status=1
    done
  done
done
exit $status
