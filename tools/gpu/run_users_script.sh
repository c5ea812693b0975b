#!/usr/bin/env bash
# bench/users_script.py on the GPU (issue 37): a user's script with strata's one line beside
# torch resident, torchao's CPUOffloadOptimizer, DeepSpeed ZeRO-Offload and FSDP2 (resident,
# CPUOffloadPolicy, strata), each run a process of its own with the device's memory polled,
# interleaved in rounds. What it writes is packed in OUT_DIR/all.tgz (gpu.txt beside it).
#   tools/gpu/run_users_script.sh OUT_DIR [users_script.py arguments, e.g. --batches 8 --rounds 2]
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_users_script.sh OUT_DIR [args]}
shift
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
python_setup "$OUT" || exit 1
install_torchao
# DeepSpeed (the deepspeed approach) and its dependencies into DS_PKGS, beside the machine's torch,
# as tools/gpu/run_deepspeed.sh does; its cpu_adam op builds on first use (about 50 s, not timed).
export DS_PKGS=/tmp/ds-pkgs CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
python3 -m pip install -q --no-index --no-deps --target "$DS_PKGS" .deps/wheels/deepspeed-*.whl \
  .deps/wheels/{einops,hjson,msgpack,ninja,psutil,py_cpuinfo,pydantic,pydantic_core}-*.whl \
  .deps/wheels/{annotated_types,typing_extensions,typing_inspection}-*.whl >"$OUT/pip.log" 2>&1 ||
  echo "deepspeed not installed (see pip.log): its runs will fail and say why"
nproc >"$OUT/cpus.txt"
free -g | head -2 >>"$OUT/cpus.txt"
PYTHONUNBUFFERED=1 python3 bench/users_script.py --json "$OUT/users_script.json" "$@" 2>&1 |
  tee "$OUT/users_script.log"
status=${PIPESTATUS[0]}
# A device call returns 8 files at most, and this writes 9 (the JSON among them): pack them.
pack_out "$OUT"
exit "$status"
