#!/usr/bin/env bash
# DeepSpeed's CPUAdam against torch's fused AdamW on the CPU (bench/deepspeed_cpu_adam.py), on a
# machine without a registry: the deepspeed wheel (built here from its source with DS_BUILD_OPS=0,
# so its cpu_adam op builds on first use) and its dependencies come from .deps/wheels, installed
# into /tmp/ds-pkgs beside the machine's torch. Output in OUT.
#   tools/gpu/run_deepspeed.sh OUT_DIR [ROUNDS]
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_deepspeed.sh OUT_DIR [ROUNDS]}
ROUNDS=${2:-7}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
PKGS=/tmp/ds-pkgs
python3 -m pip install -q --no-index --no-deps --target "$PKGS" .deps/wheels/deepspeed-*.whl \
  .deps/wheels/{einops,hjson,msgpack,ninja,psutil,py_cpuinfo,pydantic,pydantic_core}-*.whl \
  .deps/wheels/{annotated_types,typing_extensions,typing_inspection}-*.whl >"$OUT/pip.log" 2>&1 ||
  { tail -20 "$OUT/pip.log"; exit 1; }
export PYTHONPATH=$PKGS:${PYTHONPATH:-} PATH=$PKGS/bin:$PATH CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__)" |
  tee "$OUT/versions.txt"
python3 bench/deepspeed_cpu_adam.py --rounds "$ROUNDS" --json "$OUT/deepspeed_cpu_adam.json" \
  2>&1 | tee "$OUT/deepspeed_cpu_adam.log" | grep -vE "^\s*$" | tail -25
exit "${PIPESTATUS[0]}"
