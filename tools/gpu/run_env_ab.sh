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
python3 -c "import torchao" 2>/dev/null ||
  python3 -m pip install -q --no-deps --no-index --find-links .deps/wheels torchao 2>/dev/null ||
  python3 -m pip install -q --break-system-packages --no-deps --no-index --find-links .deps/wheels \
    torchao
for ((r = 0; r < ROUNDS; r++)); do
  for spec in "$@"; do
    IFS=, read -r approach envs <<<"$spec"
    log="$OUT/r$r-${spec//[^A-Za-z0-9_.-]/_}.log"
    env ${envs//;/ } timeout 200 python3 bench/users_script.py --one "$approach" --batch "$BATCH" \
      --warmup 20 --steps 8 >"$log" 2>&1
    python3 - "$log" "$spec" "$r" <<'PY' | tee -a "$OUT/summary.txt"
import hashlib, json, sys
lines = [l for l in open(sys.argv[1]) if l.startswith("RESULT ")]
if not lines:
    print(f"r{sys.argv[3]} {sys.argv[2]:<40} FAILED: " + open(sys.argv[1]).read()[-300:].replace("\n", " | "))
else:
    r = json.loads(lines[-1][7:])
    h = hashlib.md5(json.dumps(r["losses"]).encode()).hexdigest()[:8]
    print(f"r{sys.argv[3]} {sys.argv[2]:<40} {r['ms_per_step']:8.1f} ms  steps {min(r['step_ms']):.1f}-{max(r['step_ms']):.1f}  peak {r['device_peak_gib']:.2f} GiB  losses {h}  {r.get('step_outcomes')}")
PY
  done
done
rm -f "$OUT/configure.log" "$OUT/build.log"
