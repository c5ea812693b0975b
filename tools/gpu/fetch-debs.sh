#!/usr/bin/env bash
# Fetches the Debian packages that the GPU machine lacks (Abseil, GoogleTest, GoogleMock, Google
# Benchmark, nlohmann-json) into .deps/debs, and the wheels of pytest, tqdm and numpy (for
# tools/gpu/run_python.sh and run_fsdp.sh) and of DeepSpeed and its dependencies (for
# tools/gpu/run_deepspeed.sh) into .deps/wheels: an ignored folder that travels with
# the device tool's `carry`. Run it here, where a package registry is reachable;
# tools/gpu/check.sh unpacks them there.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .deps/debs
cd .deps/debs
if [ ! -f /var/lib/apt/lists/lock ] || [ -z "$(ls /var/lib/apt/lists/ 2>/dev/null | grep -v lock)" ]; then
  apt-get update -qq
fi
apt-get download libabsl-dev libabsl20220623 libgtest-dev libgmock-dev libbenchmark-dev \
  libbenchmark1debian nlohmann-json3-dev
ls -la
cd ../..
python3 -m pip download -q -d .deps/wheels pytest tqdm
# torchao for bench/users_script.py's CPUOffloadOptimizer peer (the GPU machine's Python 3.12).
python3 -m pip download -q --no-deps -d .deps/wheels --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 torchao
# numpy for torch.distributed.checkpoint, built for the GPU machine's Python 3.12.
python3 -m pip download -q -d .deps/wheels --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 numpy
# DeepSpeed's dependencies for the GPU machine's Python 3.12 (torch and numpy are there already),
# and DeepSpeed itself as a wheel built here from its source without its ops (DS_BUILD_OPS=0):
# the GPU machine builds cpu_adam when it is first used.
python3 -m pip download -q -d .deps/wheels --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 einops hjson msgpack ninja psutil py-cpuinfo "pydantic>=2"
python3 -m pip install -q wheel
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w .deps/wheels deepspeed
ls .deps/wheels
