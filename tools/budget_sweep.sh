#!/usr/bin/env bash
# The GPU budget as strata-train keeps it (issue "The GPU budget is a promise"): for bulk and
# layer_prefetch, roles optimizer_states and all, --prefetch_depth 1 and 5, and every budget from 3
# to 16 MiB in 1 MiB steps, `strata-train --steps=2 --json=F` must exit 2 at setup or exit 0 with
# peak_strata_gpu_bytes within the budget, and once a budget trains every larger one must too.
# Prints one line per configuration (budget:exit code(peak bytes)) and exits 1 if a promise broke.
#   tools/budget_sweep.sh [build/bin/strata-train]
set -uo pipefail
BIN=${1:-build/bin/strata-train}
JSON=$(mktemp)
trap 'rm -f "$JSON"' EXIT
broken=0
for policy in bulk layer_prefetch; do
  for roles in optimizer_states all; do
    for k in 1 5; do
      line="$policy --strata_roles=$roles --prefetch_depth=$k:"
      trained=0
      for mib in $(seq 3 16); do
        "$BIN" --strata_policy=$policy --strata_roles=$roles --prefetch_depth=$k \
          --strata_gpu_budget=${mib}MiB --steps=2 --json="$JSON" >/dev/null 2>&1
        rc=$?
        case $rc in
          0)
            peak=$(python3 -c "import json,sys; print(max(r['peak_strata_gpu_bytes'] for r in json.load(open(sys.argv[1]))['runs']))" "$JSON")
            line+=" $mib:0($peak)"
            trained=1
            if ((peak > mib * 1048576)); then line+="!over"; broken=1; fi ;;
          2)
            line+=" $mib:2"
            if ((trained)); then line+="!after-training"; broken=1; fi ;;
          *)
            line+=" $mib:$rc!"; broken=1 ;;
        esac
      done
      echo "$line"
    done
  done
done
((broken)) && { echo "budget sweep: a promise broke"; exit 1; }
echo "budget sweep: every run exited 2 at setup or trained within its budget, monotone in it"
