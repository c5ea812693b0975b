#!/usr/bin/env bash
# The Python package on the GPU (issue "strata for PyTorch users"): the extension built with the
# rest (build.sh configures with -DSTRATA_PYTHON=ON), the package assembled from python/strata and
# the built module (the GPU machine has no registry for pip's build backend), pytest from the
# wheels in .deps/wheels (tools/gpu/fetch-debs.sh fetches them), the whole suite with its gpu marks,
# examples/train_gpt.py on CUDA, and bench/python_step.py. Logs and JSON go to OUT.
#   tools/gpu/run_python.sh OUT_DIR
set -uo pipefail
OUT=${1:?usage: tools/gpu/run_python.sh OUT_DIR}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
source tools/gpu/build.sh
python_setup "$OUT" || exit 1
status=0
echo "== smoke (each call printed before the next)"
STRATA_SEGV_BACKTRACE=1 python3 python/tests/smoke.py >"$OUT/smoke.log" 2>&1 || status=1
tail -40 "$OUT/smoke.log"
if command -v gdb >/dev/null && ! grep -q "smoke done" "$OUT/smoke.log"; then
  gdb -batch -ex run -ex bt --args python3 python/tests/smoke.py >"$OUT/smoke-gdb.log" 2>&1
  grep -A25 "SIGSEGV" "$OUT/smoke-gdb.log" | head -40
fi
echo "== pytest"
python3 -m pytest -q -rs python/tests >"$OUT/pytest.log" 2>&1 || status=1
tail -15 "$OUT/pytest.log"
echo "== examples/train_gpt.py on CUDA, --compare"
python3 examples/train_gpt.py --device cuda --steps 30 --layers 4 --d_model 256 --compare \
  >"$OUT/train_gpt.log" 2>&1 || status=1
grep -vE "it/s\]|s/it\]" "$OUT/train_gpt.log" | tail -8
echo "== bench/python_step.py"
python3 bench/python_step.py --json "$OUT/python_step.json" >"$OUT/python_step.log" 2>&1 || status=1
grep -E "median|ratio|gpu" "$OUT/python_step.log"
exit $status
