#!/usr/bin/env bash
# What running each layer's overlapped step on a stream of its own gains (Note [The step stream] in
# bridge/model_hooks.cpp): tools/gpu/run_ab.sh with --strata_step_stream=own against =compute, files
# tagged PART-own-rN / PART-compute-rN.
#   tools/gpu/run_step_stream.sh OUT_DIR PART... [-- EXTRA...]
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_step_stream.sh OUT_DIR PART... [-- EXTRA...]}
shift
exec "$(dirname "$0")/run_ab.sh" "$OUT" own=--strata_step_stream=own \
  compute=--strata_step_stream=compute "$@"
