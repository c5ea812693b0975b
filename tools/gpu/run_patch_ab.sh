#!/usr/bin/env bash
# The working tree against a base that is the working tree with PATCH reversed (make PATCH with
# `git diff BASE > PATCH` here, in a folder the command carries; files git does not track yet are
# not in it, so the base has them too), both built, then
# bench/users_script.py approaches run base and new alternately, each a process of its own, with a
# line a run: ms, the step times' range, peak and the md5 of its losses. Approaches that do not
# use strata run once a round. A run's log is kept only when it failed.
#   tools/gpu/run_patch_ab.sh OUT PATCH BATCH ROUNDS APPROACH ...
# e.g. tools/gpu/run_patch_ab.sh OUT .ab/new.patch 32 2 resident strata fsdp2 fsdp2_strata
# WARMUP and STEPS (default 20 and 8) set each run's untimed and timed steps: the hybrid's search
# and its choice of where to step take some 60 steps before it runs as it will for the rest of a
# run.
set -uo pipefail
OUT=$(realpath -m "${1:?}"); PATCH=$(realpath "${2:?}"); BATCH=${3:?}; ROUNDS=${4:?}; shift 4
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
python_setup "$OUT" || exit 1
rm -rf /tmp/pkg-new && mv /tmp/strata-pkg /tmp/pkg-new
base_tree "$PATCH" &&
  (cd /tmp/strata-base && BUILD=/tmp/strata-build-base && gpu_build "$OUT/base" _strata &&
    python_package) || { echo "the base did not build"; exit 1; }
rm -rf /tmp/pkg-base && mv /tmp/strata-pkg /tmp/pkg-base
for ((r = 0; r < ROUNDS; r++)); do
  for approach in "$@"; do
    sides=(new)
    [[ $approach == *strata* ]] && sides=(base new)
    ((r % 2)) && [[ ${#sides[@]} == 2 ]] && sides=(new base)
    for side in "${sides[@]}"; do
      log="$OUT/r$r-$approach-$side.log"
      PYTHONPATH=/tmp/pkg-$side timeout "${RUN_TIMEOUT:-200}" python3 bench/users_script.py \
        --one "$approach" --batch "$BATCH" --warmup "${WARMUP:-20}" --steps "${STEPS:-8}" >"$log" 2>&1
      python3 tools/gpu/summarize_run.py "$log" "$approach $side" "$r" | tee -a "$OUT/summary.txt"
      # Every step's time and where it ran, a line a run; a failed run's log comes back.
      grep "^RESULT " "$log" | sed "s/^RESULT /r$r $approach $side /" >>"$OUT/results.txt"
      grep -q "^RESULT " "$log" && rm -f "$log"
    done
  done
done
rm -rf "$OUT/base" "$OUT/configure.log" "$OUT/build.log"
pack_out "$OUT"
