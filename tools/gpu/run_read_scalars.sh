#!/usr/bin/env bash
# Reading a step's scalars without the copy engine on the GPU (bridge::ScalarReader and
# strata.read_scalars): the C++ suite's Gpu tests, the Python package's gpu-marked tests (the
# overlapped step's validation reads its clip coefficient this way), and the probe that times
# loss.item() against strata.read_scalars(loss) while a copy to the host runs on a side stream.
# Logs go to OUT.
#   tools/gpu/run_read_scalars.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_read_scalars.sh OUT_DIR}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
gpu_build "$OUT" bridge_scalars_test || exit 1
python_setup "$OUT" || exit 1
status=0
echo "== bridge_scalars_test (Gpu tests)"
GTEST_FILTER='*Gpu*' "$BUILD/bin/bridge_scalars_test" >"$OUT/bridge_scalars_gpu.log" 2>&1 || status=1
tail -3 "$OUT/bridge_scalars_gpu.log"
echo "== pytest -m gpu"
python3 -m pytest -q -rs -m gpu python/tests >"$OUT/pytest_gpu.log" 2>&1 || status=1
tail -4 "$OUT/pytest_gpu.log"
echo "== tools/gpu/probes/read_scalars.py"
for gib in 1 4; do
  python3 tools/gpu/probes/read_scalars.py "$gib" 2>&1 | tee -a "$OUT/read_scalars.txt" || status=1
done
exit $status
