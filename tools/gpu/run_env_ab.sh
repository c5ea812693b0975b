#!/usr/bin/env bash
# bench/users_script.py approaches, each a process of its own, under environment
# settings given after a comma, interleaved in rounds; a line a run with ms,
# peak and the md5 of its losses.
#   tools/gpu/run_env_ab.sh OUT BATCH ROUNDS APPROACH[,NAME=VALUE[;NAME=VALUE]] ...
# e.g. tools/gpu/run_env_ab.sh OUT 32 2 strata strata,CUDA_DEVICE_MAX_CONNECTIONS=32
set -uo pipefail
OUT=${1:?}; BATCH=${2:?}; ROUNDS=${3:?}; shift 3
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
python_setup "$OUT" || exit 1
install_torchao
for ((r = 0; r < ROUNDS; r++)); do
  for spec in "$@"; do
    IFS=, read -r approach envs <<<"$spec"
    log="$OUT/r$r-${spec//[^A-Za-z0-9_.-]/_}.log"
    env ${envs//;/ } timeout 200 python3 bench/users_script.py --one "$approach" --batch "$BATCH" \
      --warmup 20 --steps 8 >"$log" 2>&1
    python3 tools/gpu/summarize_run.py "$log" "$spec" "$r" | tee -a "$OUT/summary.txt"
  done
done
rm -f "$OUT/configure.log" "$OUT/build.log"
