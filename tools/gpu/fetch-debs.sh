#!/usr/bin/env bash
# Fetches the Debian packages that the GPU machine lacks (Abseil, GoogleTest, GoogleMock, Google
# Benchmark, nlohmann-json) into .deps/debs, and the wheels of pytest, tqdm and numpy into
# .deps/wheels (for tools/gpu/run_python.sh and run_fsdp.sh): an ignored folder that travels with
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
# numpy for torch.distributed.checkpoint, built for the GPU machine's Python 3.12.
python3 -m pip download -q -d .deps/wheels --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 numpy
ls .deps/wheels
