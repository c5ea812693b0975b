#!/usr/bin/env bash
# bench/users_script.py on the GPU (issue 37): a user's script with strata's one line beside
# torch resident, torchao's CPUOffloadOptimizer and FSDP2 (resident, CPUOffloadPolicy, strata),
# each run a process of its own with the device's memory polled, interleaved in rounds.
#   tools/gpu/run_users_script.sh OUT_DIR [users_script.py arguments, e.g. --batches 8 --rounds 2]
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_users_script.sh OUT_DIR [args]}
shift
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
python_setup "$OUT" || exit 1
python3 -c "import torchao" 2>/dev/null ||
  python3 -m pip install -q --no-deps --no-index --find-links .deps/wheels torchao 2>/dev/null ||
  python3 -m pip install -q --break-system-packages --no-deps --no-index --find-links .deps/wheels \
    torchao
nproc >"$OUT/cpus.txt"
free -g | head -2 >>"$OUT/cpus.txt"
PYTHONUNBUFFERED=1 python3 bench/users_script.py --json "$OUT/users_script.json" "$@" 2>&1 |
  tee "$OUT/users_script.log"
